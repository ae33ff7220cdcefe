// StreamPlayer: plays chunked video (a few JPEG frames per chunk) smoothly at the model's frame rate.
//
// Buffering design (docs/frontend.md has the long version):
//  * Chunks are decoded with createImageBitmap (off the main thread), in arrival order (a promise
//    chain), into a FIFO of frames. Duplicate or older chunk indices are dropped.
//  * Jitter buffer: playback starts once `prebufferChunks` chunks (one by default) are decoded, then
//    runs on a requestAnimationFrame clock: a frame is shown when its due time comes, never on
//    arrival, and the next one is due one frame interval later. Irregular chunk arrival (batching,
//    generation and network jitter) is absorbed by the buffer and does not show as stutter.
//  * Rate matching: when chunks arrive more slowly than real time (an overloaded GPU), a
//    fixed-rate player would freeze at every chunk boundary. While the buffer holds less than two
//    chunks, the frame interval stretches to the smoothed chunk inter-arrival time (at most
//    `maxSlowdown`× the nominal), so the video plays slightly slower instead of stop-and-go.
//  * Underrun (the buffer runs dry anyway): hold the last frame, report "stalled", refill to the
//    prebuffer level, resume with the clock re-anchored (no fast-forward over the wait).
//  * Overrun (a burst after a reconnect, or a background tab where rAF does not run): frames beyond
//    `maxBufferChunks` are skipped oldest first, so the delay to live stays bounded.

export function playbackRate({ arrivalMs, chunkMs, bufferedChunks, maxSlowdown = 1.5 }) {
  // Frame interval multiplier: 1 = nominal fps; > 1 = slower, to match a slow producer.
  if (!arrivalMs || !chunkMs || bufferedChunks >= 2) return 1;
  return Math.min(maxSlowdown, Math.max(1, arrivalMs / chunkMs));
}

// Exponentially weighted inter-arrival time; gaps much longer than a chunk (a pause, a suspension,
// a reconnect) are not the producer's pace and are left out.
export function smoothArrival(previous, gapMs, chunkMs, weight = 0.3) {
  if (!(gapMs > 0) || (chunkMs && gapMs > 3 * chunkMs)) return previous;
  return previous ? previous + weight * (gapMs - previous) : gapMs;
}

// A session's timing as its chunk headers give it (frames per second, frames per chunk), which
// every player paces by.
class ChunkClock {
  constructor() {
    this.fps = 16;
    this.framesPerChunk = 12;
  }

  get frameMs() {
    return 1000 / this.fps;
  }

  get chunkMs() {
    return this.framesPerChunk * this.frameMs;
  }

  configure({ fps, framesPerChunk }) {
    if (fps) this.fps = fps;
    if (framesPerChunk) this.framesPerChunk = framesPerChunk;
  }
}

export class StreamPlayer extends ChunkClock {
  // onPresented(index, time): the first frame of chunk `index` is on screen; `time` is on the
  // performance.now() clock (the animation frame that drew it).
  constructor(
    canvas,
    { prebufferChunks = 1, maxBufferChunks = 4, maxSlowdown = 1.5, onState = () => {}, onPresented = () => {} } = {},
  ) {
    super();
    this.canvas = canvas;
    this.onPresented = onPresented;
    this.ctx = canvas.getContext("2d");
    this.prebufferChunks = prebufferChunks;
    this.maxBufferChunks = maxBufferChunks;
    this.maxSlowdown = maxSlowdown;
    this.onState = onState;
    this.reset();
    this._tick = this._tick.bind(this);
    this._raf = requestAnimationFrame(this._tick);
  }

  reset() {
    for (const frame of this.queue || []) frame.bitmap.close();
    this.queue = [];
    this.decodeChain = Promise.resolve();
    this.lastQueuedIndex = -1;
    this.lastPresentedIndex = -1;
    this.lastArrival = 0;
    this.arrivalMs = 0;
    this.state = "idle"; // idle → buffering → playing ⇄ stalled
    this.nextDue = 0;
    this.rate = 1;
    this.stats = {
      framesShown: 0,
      framesSkipped: 0,
      stalls: 0,
      chunksDecoded: 0,
      decodeErrors: 0,
      shownChunkIndex: null,
    };
    this._emit();
  }

  configure({ width, height, fps, framesPerChunk }) {
    super.configure({ fps, framesPerChunk });
    if (width && height && (this.canvas.width !== width || this.canvas.height !== height)) {
      this.canvas.width = width;
      this.canvas.height = height;
    }
  }

  // frames: Uint8Array[] of encoded images; resolves once the chunk is queued (or dropped).
  pushChunk(header, frames) {
    const arrivedAt = performance.now();
    const mime = header.mime || "image/jpeg";
    this.decodeChain = this.decodeChain.then(async () => {
      if (header.index <= this.lastQueuedIndex) return; // a duplicate after a reconnect
      let bitmaps;
      try {
        bitmaps = await Promise.all(frames.map((bytes) => createImageBitmap(new Blob([bytes], { type: mime }))));
      } catch (err) {
        this.stats.decodeErrors += 1;
        this._emit();
        throw err;
      }
      this.configure({
        width: header.width || bitmaps[0]?.width,
        height: header.height || bitmaps[0]?.height,
        fps: header.fps,
        framesPerChunk: bitmaps.length || undefined,
      });
      if (this.lastArrival) this.arrivalMs = smoothArrival(this.arrivalMs, arrivedAt - this.lastArrival, this.chunkMs);
      this.lastArrival = arrivedAt;
      this.lastQueuedIndex = header.index;
      for (const bitmap of bitmaps) this.queue.push({ bitmap, chunk: header.index });
      this.stats.chunksDecoded += 1;
      this._trimOverrun();
      if (this.state !== "playing" && this._prebuffered()) this._start();
      else if (this.state === "idle") this.state = "buffering";
      this._emit();
    });
    const result = this.decodeChain;
    this.decodeChain = this.decodeChain.catch(() => {}); // one bad chunk must not stop the next ones
    return result;
  }

  destroy() {
    cancelAnimationFrame(this._raf);
    this.reset();
  }

  _prebuffered() {
    return this.queue.length >= Math.max(1, this.prebufferChunks * this.framesPerChunk);
  }

  _trimOverrun() {
    const limit = this.maxBufferChunks * this.framesPerChunk;
    while (this.queue.length > limit) {
      this.queue.shift().bitmap.close();
      this.stats.framesSkipped += 1;
    }
  }

  _start() {
    if (this.state === "stalled") this.stats.stalls += 1;
    this.nextDue = performance.now(); // re-anchored: the first frame is due now
    this.state = "playing";
  }

  _tick(now) {
    this._raf = requestAnimationFrame(this._tick);
    if (this.state !== "playing" || now < this.nextDue) return;
    if (!this.queue.length) {
      this.state = "stalled";
      this._emit();
      return;
    }
    const frame = this.queue.shift();
    this.ctx.drawImage(frame.bitmap, 0, 0, this.canvas.width, this.canvas.height);
    frame.bitmap.close();
    this.rate = playbackRate({
      arrivalMs: this.arrivalMs,
      chunkMs: this.chunkMs,
      bufferedChunks: this.queue.length / this.framesPerChunk,
      maxSlowdown: this.maxSlowdown,
    });
    const interval = this.frameMs * this.rate;
    // Keep the cadence exact (due times, not "now + interval"), but never try to catch up on
    // frames a throttled tab missed: that would flash them by.
    this.nextDue = now - this.nextDue > interval ? now + interval : this.nextDue + interval;
    this.stats.framesShown += 1;
    this.stats.shownChunkIndex = frame.chunk;
    if (frame.chunk > this.lastPresentedIndex) {
      this.lastPresentedIndex = frame.chunk;
      this.onPresented(frame.chunk, now);
    }
    this._emit();
  }

  _emit() {
    this.onState({ state: this.state, bufferedFrames: this.queue.length, rate: this.rate, ...this.stats });
  }
}

// MsePlayer: plays H.264 chunks (fragmented MP4) in a <video> through Media Source Extensions, with
// the same surface as StreamPlayer (pushChunk, reset, destroy, configure, onState).
//
// Design (docs/frontend.md has the long version):
//  * One MediaSource, one SourceBuffer in "segments" mode: each fragment's tfdt already places it at
//    chunk_index × frames_per_chunk on the session's timeline, so a viewer that joins late, a
//    reconnect, or a dropped chunk leaves a hole in the buffered ranges, not a shifted timeline.
//  * appendBuffer is asynchronous: appends and removals go through one queue, the next one
//    starting on the previous one's updateend.
//  * Playback starts at the first buffered time; a `<video>` stalled in a hole (currentTime at the
//    end of a range, a later range buffered) is seeked to the next range's start.
//  * Bounded latency: when the live edge is more than `maxBehindChunks` chunks ahead of
//    currentTime, it seeks to one chunk behind the live edge; media more than `keepChunks` chunks
//    behind currentTime is removed, so the SourceBuffer never fills up.
//  * An init segment with a different MIME (another profile or level) re-creates the MediaSource
//    and its SourceBuffer: a SourceBuffer's codec is fixed when it is added.
//  * Errors (an append refused, the element's MEDIA_ERR_DECODE) count as decodeErrors and are
//    reported through `onError`, so the page can fall back to JPEG.

const GAP_CHECK_MS = 200;
const HOLE_TOLERANCE_S = 0.08; // what counts as "at the end of a range": a frame or so

// The index of the range holding `time`, or -1 (a hole); ranges are a TimeRanges.
export function rangeIndex(ranges, time, tolerance = 0) {
  for (let i = 0; i < ranges.length; i += 1) {
    if (time >= ranges.start(i) - tolerance && time < ranges.end(i) - tolerance) return i;
  }
  return -1;
}

// Where a live player should be: `null` (stay) or the time to seek to. `ranges` is a TimeRanges (or
// anything with length/start/end); `chunkS` one chunk's duration in seconds.
export function liveSeekTarget(ranges, currentTime, { chunkS, maxBehindChunks = 2 }) {
  if (!ranges.length) return null;
  const liveEdge = ranges.end(ranges.length - 1);
  if (liveEdge - currentTime > maxBehindChunks * chunkS) {
    // Behind live: one chunk behind the edge, but never before the last range's start (a hole).
    return Math.max(ranges.start(ranges.length - 1), liveEdge - chunkS);
  }
  if (rangeIndex(ranges, currentTime, HOLE_TOLERANCE_S) === -1) {
    // In a hole (or at a range's end): the next range that starts after currentTime.
    for (let i = 0; i < ranges.length; i += 1) {
      if (ranges.start(i) > currentTime - HOLE_TOLERANCE_S && ranges.end(i) > currentTime + HOLE_TOLERANCE_S) {
        return ranges.start(i);
      }
    }
  }
  return null;
}

export class MsePlayer extends ChunkClock {
  // onPresented(index, time): as StreamPlayer's; `time` is the frame's presentationTime from
  // requestVideoFrameCallback (not reported where the browser lacks it).
  constructor(
    video,
    { maxBehindChunks = 2, keepChunks = 2, onState = () => {}, onError = () => {}, onPresented = () => {} } = {},
  ) {
    super();
    this.video = video;
    this.onPresented = onPresented;
    this.maxBehindChunks = maxBehindChunks;
    this.keepChunks = keepChunks;
    this.onState = onState;
    this.onError = onError;
    this.video.muted = true;
    this.video.playsInline = true;
    this._onVideoError = () => {
      const error = this.video.error;
      if (!error || !this.mediaSource) return;
      this._fail(`the video element failed: ${error.message || `media error ${error.code}`}`);
    };
    this._onWaiting = () => this._check();
    this.video.addEventListener("error", this._onVideoError);
    this.video.addEventListener("waiting", this._onWaiting);
    this.reset();
    this._timer = setInterval(() => this._check(), GAP_CHECK_MS);
  }

  reset() {
    this._detach();
    this.operations = []; // {kind: "append"|"remove", ..., resolve, reject}
    this.lastQueuedIndex = -1;
    this.lastPresentedIndex = -1;
    this.appendedInit = null; // the init segment the SourceBuffer was last given
    this.mime = null;
    this.state = "idle"; // idle → buffering → playing ⇄ stalled
    this.failed = false;
    this._presented = 0;
    this.stats = {
      framesShown: 0,
      decodedFrames: 0,
      stalls: 0,
      chunksDecoded: 0,
      decodeErrors: 0,
      seeks: 0,
      shownChunkIndex: null,
    };
    this._emit();
  }

  destroy() {
    clearInterval(this._timer);
    this.video.removeEventListener("error", this._onVideoError);
    this.video.removeEventListener("waiting", this._onWaiting);
    this._detach();
    this.operations = [];
  }

  // frames: [init, fragment] when header.init, else [fragment]. Resolves once the fragment is in the
  // SourceBuffer (or dropped as a duplicate); rejects when the browser refuses it.
  pushChunk(header, frames) {
    if (this.failed) return Promise.reject(new Error("the H.264 player has failed"));
    const fragment = frames[frames.length - 1];
    const init = header.init ? frames[0] : null;
    if (init) this.pendingInit = { mime: header.mime, bytes: init };
    if (header.fps) this.fps = header.fps;
    if (header.frames_per_chunk) this.framesPerChunk = header.frames_per_chunk;
    if (header.index <= this.lastQueuedIndex) return Promise.resolve(); // a duplicate after a reconnect
    this.lastQueuedIndex = header.index;
    if (this.pendingInit) {
      const { mime, bytes } = this.pendingInit;
      this.pendingInit = null;
      if (mime !== this.mime) {
        this._open(mime);
        if (this.mime !== mime) return Promise.reject(new Error(`this browser cannot play ${mime}`));
      }
      if (!sameBytes(bytes, this.appendedInit)) {
        this.appendedInit = bytes;
        this._enqueue({ kind: "append", bytes }).catch(() => {});
      }
    }
    if (!this.mime) return Promise.reject(new Error(`chunk ${header.index} came before any init segment`));
    if (this.state === "idle") this.state = "buffering";
    const appended = this._enqueue({ kind: "append", bytes: fragment, index: header.index }).then(() => {
      this.stats.chunksDecoded += 1;
      this._check();
    });
    return appended;
  }

  // --- MediaSource plumbing -----------------------------------------------------------------------

  _open(mime) {
    this._detach();
    if (!window.MediaSource || !MediaSource.isTypeSupported(mime)) {
      this._fail(`this browser cannot play ${mime}`);
      return;
    }
    this.mime = mime;
    const mediaSource = new MediaSource();
    this.mediaSource = mediaSource;
    this.sourceBuffer = null;
    this.objectUrl = URL.createObjectURL(mediaSource);
    mediaSource.addEventListener(
      "sourceopen",
      () => {
        if (this.mediaSource !== mediaSource) return;
        URL.revokeObjectURL(this.objectUrl);
        let buffer;
        try {
          buffer = mediaSource.addSourceBuffer(mime);
          buffer.mode = "segments";
        } catch (err) {
          this._fail(`the SourceBuffer was refused: ${err.message}`);
          return;
        }
        this.sourceBuffer = buffer;
        buffer.addEventListener("updateend", () => this._finishOperation(null));
        buffer.addEventListener("error", () => this._finishOperation(new Error("the SourceBuffer failed")));
        this._runNext();
      },
      { once: true },
    );
    this.video.src = this.objectUrl;
    this._watchFrames();
  }

  _detach() {
    if (!this.mediaSource) return;
    for (const op of this.operations || []) op.reject(new Error("the player was reset"));
    this.operations = [];
    const mediaSource = this.mediaSource;
    this.mediaSource = null;
    this.sourceBuffer = null;
    this.mime = null;
    this.appendedInit = null;
    this.pendingInit = null;
    if (mediaSource.readyState === "open") {
      try {
        mediaSource.endOfStream();
      } catch {
        // an append in flight: the element is released below anyway
      }
    }
    this.video.removeAttribute("src");
    this.video.load();
  }

  _enqueue(op) {
    return new Promise((resolve, reject) => {
      this.operations.push({ ...op, resolve, reject, started: false });
      this._runNext();
    });
  }

  _runNext() {
    const buffer = this.sourceBuffer;
    const op = this.operations[0];
    if (!buffer || !op || op.started || buffer.updating) return;
    op.started = true;
    try {
      if (op.kind === "append") buffer.appendBuffer(op.bytes);
      else buffer.remove(op.start, op.end);
    } catch (err) {
      this._finishOperation(err);
    }
  }

  _finishOperation(error) {
    const op = this.operations[0];
    if (!op || !op.started) return;
    this.operations.shift();
    if (error) {
      op.reject(error);
      if (op.kind === "append") this._fail(`chunk ${op.index ?? "init"} was refused: ${error.message}`);
      return;
    }
    op.resolve();
    this._runNext();
  }

  _fail(reason) {
    this.stats.decodeErrors += 1;
    this.failed = true;
    this._emit();
    this.onError(reason);
  }

  // --- Playback: start, holes, latency, trimming, counters -----------------------------------------

  _check() {
    const video = this.video;
    const buffer = this.sourceBuffer;
    if (!buffer || this.failed) return;
    const ranges = buffer.buffered;
    if (!ranges.length) return;
    const chunkS = this.chunkMs / 1000;
    const now = video.currentTime;
    const target = liveSeekTarget(ranges, now, { chunkS, maxBehindChunks: this.maxBehindChunks });
    if (target !== null && Math.abs(target - now) > HOLE_TOLERANCE_S / 2) {
      video.currentTime = target;
      this.stats.seeks += 1;
    }
    if (video.paused && !video.seeking) video.play().catch(() => {}); // muted: autoplay is allowed
    // Trim what is well behind the playhead (one queued removal at a time).
    const oldest = ranges.start(0);
    const keepFrom = video.currentTime - this.keepChunks * chunkS;
    if (keepFrom - oldest > chunkS && !this.operations.some((op) => op.kind === "remove")) {
      this._enqueue({ kind: "remove", start: 0, end: keepFrom }).catch(() => {});
    }
    // HAVE_FUTURE_DATA: the element has the next frame; below it, it waits at a range's end.
    const playing = !video.paused && video.readyState >= HTMLMediaElement.HAVE_FUTURE_DATA;
    const was = this.state;
    if (playing) this.state = "playing";
    else if (was === "playing" && !video.seeking) {
      // A seek of ours (to the live edge, over a hole) is not a stall: the element waits on no chunk.
      this.state = "stalled";
      this.stats.stalls += 1;
    }
    const quality = video.getVideoPlaybackQuality?.();
    if (quality) this.stats.decodedFrames = quality.totalVideoFrames;
    if (!("requestVideoFrameCallback" in HTMLVideoElement.prototype) && quality) {
      this.stats.framesShown = quality.totalVideoFrames - quality.droppedVideoFrames;
    }
    this._emit();
  }

  _watchFrames() {
    if (!("requestVideoFrameCallback" in HTMLVideoElement.prototype)) return;
    const video = this.video;
    const mediaSource = this.mediaSource;
    this._presented = 0;
    const onFrame = (_now, meta) => {
      if (this.mediaSource !== mediaSource) return; // a newer MediaSource has its own callback
      // presentedFrames counts per element load; several frames may be presented between callbacks.
      const delta = meta.presentedFrames - this._presented;
      this._presented = meta.presentedFrames;
      this.stats.framesShown += delta > 0 ? delta : 1;
      const index = Math.floor((meta.mediaTime * this.fps + 0.5) / this.framesPerChunk);
      this.stats.shownChunkIndex = index;
      if (index > this.lastPresentedIndex) {
        this.lastPresentedIndex = index;
        this.onPresented(index, meta.presentationTime);
      }
      this._emit();
      video.requestVideoFrameCallback(onFrame);
    };
    video.requestVideoFrameCallback(onFrame);
  }

  _emit() {
    const ranges = this.sourceBuffer?.buffered;
    const ahead = ranges?.length ? Math.max(0, ranges.end(ranges.length - 1) - this.video.currentTime) : 0;
    this.onState({
      state: this.state,
      bufferedFrames: Math.round(ahead * this.fps),
      rate: 1,
      framesSkipped: 0,
      ...this.stats,
    });
  }
}

function sameBytes(a, b) {
  if (!a || !b || a.length !== b.length) return false;
  for (let i = 0; i < a.length; i += 1) if (a[i] !== b[i]) return false;
  return true;
}

// WebRtcPlayer: plays a session's H.264 over a WebRTC peer connection whose signalling rides on the
// session socket (`?transport=webrtc`), with the same surface as the other players (reset, destroy,
// configure, onState) plus `connect(send)` and `handleMessage(message)` for the socket's signalling.
//
//  * The browser offers (receive-only video) and the server answers: the server sends the worker's
//    H.264 as it was encoded, paced by its timestamps; its answer carries all its candidates, ours
//    trickle as `webrtc.ice`.
//  * No media within a timeout falls back (`onError`, the page reopens the socket without WebRTC):
//    not connected `connectTimeoutMs` after the offer, or the server announced a chunk
//    (`webrtc.chunk`, sent as its first picture leaves) and no picture was presented within
//    `mediaTimeoutMs`. A session that is queued or paused sends no chunk and so never trips it.
//  * Counters: pictures presented (requestVideoFrameCallback), stalls (the receiver's freezeCount),
//    buffer (the jitter buffer's delay, in frames), from getStats once a second. The chunk shown is
//    the last one announced before the picture was received (exact to within the jitter buffer).

const WEBRTC_STATS_MS = 1000;

// Which presented picture starts which chunk: the server's `webrtc.chunk` says the RTP timestamp of
// the chunk's first picture less its sender's random origin (`rtp_pts`), and requestVideoFrameCallback
// gives each presented picture's `rtpTimestamp`. The origin is learnt once per peer connection from
// the first picture presented, which is a chunk's first (each chunk is a closed GOP: the decoder can
// start at nothing else) and is matched to the chunk announced closest to its arrival (chunks are a
// chunk's length apart, the announcement and the picture leave together); from then on a picture
// starts chunk i exactly when its rtpTimestamp − origin ≡ rtp_pts of i (mod 2^32).
const RTP_WRAP = 2 ** 32;
const ANCHOR_SLACK_MS = 250; // announcement vs picture arrival, either first

export class WebRtcPlayer extends ChunkClock {
  // onPresented(index, time): as MsePlayer's, for the first picture of chunk `index`.
  constructor(
    video,
    { iceServers = [], connectTimeoutMs = 10000, mediaTimeoutMs = 5000, onState = () => {}, onError = () => {}, onPresented = () => {} } = {},
  ) {
    super();
    this.video = video;
    this.iceServers = iceServers;
    this.connectTimeoutMs = connectTimeoutMs;
    this.mediaTimeoutMs = mediaTimeoutMs;
    this.onState = onState;
    this.onError = onError;
    this.onPresented = onPresented;
    this.video.muted = true;
    this.video.playsInline = true;
    this.pc = null;
    this.reset();
    this._timer = setInterval(() => this._check(), WEBRTC_STATS_MS / 2);
  }

  reset() {
    this._close();
    this.state = "idle";
    this.failed = false;
    this.announced = []; // [{index, at, rtpPts}] of the last chunks the server said it sent
    this.rtpOrigin = null; // the sender's RTP timestamp origin, once learnt
    this.firstPicture = null; // {rtp, at, time} of the first picture, until it is matched
    this.startsShown = []; // [{rel, time}] of recent pictures, for an announcement that comes late
    this.waitingSince = null; // a chunk was announced and no picture presented since
    this.lastFrameAt = 0;
    this.lastStatsAt = 0;
    this.jitter = { delay: 0, emitted: 0 };
    this.stats = {
      framesShown: 0,
      decodedFrames: 0,
      stalls: 0,
      chunksDecoded: 0,
      decodeErrors: 0,
      bufferedFrames: 0,
      shownChunkIndex: null,
      connectionState: "new",
    };
    this._emit();
  }

  destroy() {
    clearInterval(this._timer);
    this._close();
  }

  // A new socket is open: a new peer connection, offered over it (`send` posts one JSON message).
  async connect(send) {
    this._close();
    this.failed = false;
    const pc = new RTCPeerConnection({ iceServers: this.iceServers });
    this.pc = pc;
    this.offeredAt = performance.now();
    pc.addTransceiver("video", { direction: "recvonly" });
    pc.ontrack = (event) => {
      if (this.pc !== pc) return;
      this.video.srcObject = event.streams[0] || new MediaStream([event.track]);
      this.video.play().catch(() => {}); // muted: autoplay is allowed
      this._watchFrames(pc);
    };
    pc.onicecandidate = (event) => {
      if (this.pc !== pc) return;
      const c = event.candidate;
      send({ type: "webrtc.ice", candidate: c ? c.candidate : "", sdpMid: c ? c.sdpMid : null, sdpMLineIndex: c ? c.sdpMLineIndex : null });
    };
    pc.onconnectionstatechange = () => {
      if (this.pc !== pc) return;
      this.stats.connectionState = pc.connectionState;
      if (pc.connectionState === "failed") this._fail("the peer connection failed");
      this._emit();
    };
    const offer = await pc.createOffer();
    await pc.setLocalDescription(offer);
    if (this.pc !== pc) return;
    send({ type: "webrtc.offer", sdp: pc.localDescription.sdp });
  }

  // The socket's WebRTC messages: the answer, the server's view of the connection, chunk announcements.
  async handleMessage(message) {
    const pc = this.pc;
    if (!pc) return;
    if (message.type === "webrtc.answer") {
      try {
        await pc.setRemoteDescription({ type: "answer", sdp: message.sdp });
      } catch (err) {
        this._fail(`the server's answer was refused: ${err.message}`);
      }
    } else if (message.type === "webrtc.state" && message.state === "failed") {
      this._fail("the server's side of the peer connection failed");
    } else if (message.type === "webrtc.chunk") {
      if (message.fps) this.fps = message.fps;
      const rtpPts = typeof message.rtp_pts === "number" ? message.rtp_pts % RTP_WRAP : null;
      const announced = { index: message.index, at: performance.now(), rtpPts };
      this.announced.push(announced);
      if (this.announced.length > 8) this.announced.shift();
      this._matchLateAnnouncement(announced);
      this.stats.chunksDecoded += 1;
      if (this.waitingSince === null) this.waitingSince = performance.now();
    }
  }

  _close() {
    if (this.pc) this.pc.close();
    this.pc = null;
    if (this.video.srcObject) this.video.srcObject = null;
  }

  _fail(reason) {
    if (this.failed) return;
    this.failed = true;
    this.stats.decodeErrors += 1;
    this._close();
    this._emit();
    this.onError(reason);
  }

  _watchFrames(pc) {
    if (!("requestVideoFrameCallback" in HTMLVideoElement.prototype)) return;
    const video = this.video;
    const onFrame = (now, meta) => {
      if (this.pc !== pc) return;
      this.stats.framesShown += 1;
      this.lastFrameAt = now;
      this.waitingSince = null;
      this._mapPicture(meta, now);
      if (this.state !== "playing") this.state = "playing";
      this._emit();
      video.requestVideoFrameCallback(onFrame);
    };
    video.requestVideoFrameCallback(onFrame);
  }

  // The chunk this presented picture starts, if it starts one (see RTP_WRAP above).
  _mapPicture(meta, now) {
    const time = meta.presentationTime ?? now;
    const received = meta.receiveTime ?? time;
    if (typeof meta.rtpTimestamp !== "number") {
      // No RTP metadata: the last chunk announced before the picture arrived.
      const shown = this.announced.filter((a) => a.at <= received + 20).pop();
      if (shown) this.stats.shownChunkIndex = shown.index;
      return;
    }
    if (this.rtpOrigin === null) {
      // This picture anchors the origin (and is reported by _anchor), now or when its announcement comes.
      if (this.firstPicture === null) this.firstPicture = { rtp: meta.rtpTimestamp, at: received, time };
      this._anchor();
      return;
    }
    const rel = (meta.rtpTimestamp - this.rtpOrigin + RTP_WRAP) % RTP_WRAP;
    const chunk = this.announced.find((a) => a.rtpPts === rel);
    if (chunk) {
      this._presented(chunk.index, time);
    } else {
      this.startsShown.push({ rel, time });
      if (this.startsShown.length > 48) this.startsShown.shift();
    }
  }

  // The origin from the first picture and the announcement nearest its arrival.
  _anchor() {
    const first = this.firstPicture;
    if (first === null) return;
    const near = this.announced
      .filter((a) => a.rtpPts !== null && Math.abs(a.at - first.at) <= ANCHOR_SLACK_MS)
      .sort((a, b) => Math.abs(a.at - first.at) - Math.abs(b.at - first.at))[0];
    if (!near) return;
    this.rtpOrigin = (first.rtp - near.rtpPts + RTP_WRAP) % RTP_WRAP;
    this.firstPicture = null;
    this._presented(near.index, first.time);
  }

  _matchLateAnnouncement(announced) {
    if (this.rtpOrigin === null) {
      this._anchor();
      return;
    }
    const shown = this.startsShown.find((p) => p.rel === announced.rtpPts);
    if (shown) this._presented(announced.index, shown.time);
  }

  _presented(index, time) {
    this.stats.shownChunkIndex = index;
    this.onPresented(index, time);
  }

  async _check() {
    const pc = this.pc;
    if (!pc || this.failed) return;
    const now = performance.now();
    if (pc.connectionState !== "connected" && now - this.offeredAt > this.connectTimeoutMs) {
      this._fail(`the peer connection did not connect within ${this.connectTimeoutMs / 1000} s`);
      return;
    }
    if (this.waitingSince !== null && now - this.waitingSince > this.mediaTimeoutMs) {
      this._fail(`no picture arrived within ${this.mediaTimeoutMs / 1000} s of the server sending one`);
      return;
    }
    if (this.state === "playing" && now - this.lastFrameAt > 3 * this.frameMs) this.state = "stalled";
    if (now - this.lastStatsAt >= WEBRTC_STATS_MS) {
      this.lastStatsAt = now;
      await this._readStats(pc);
    }
    this._emit();
  }

  async _readStats(pc) {
    let report;
    try {
      report = await pc.getStats();
    } catch {
      return;
    }
    for (const s of report.values()) {
      if (s.type !== "inbound-rtp" || s.kind !== "video") continue;
      this.stats.decodedFrames = s.framesDecoded ?? this.stats.decodedFrames;
      this.stats.stalls = s.freezeCount ?? this.stats.stalls;
      // The jitter buffer's delay over the last second, in frames.
      const delay = (s.jitterBufferDelay ?? 0) - this.jitter.delay;
      const emitted = (s.jitterBufferEmittedCount ?? 0) - this.jitter.emitted;
      if (emitted > 0) this.stats.bufferedFrames = Math.round((delay / emitted) * this.fps);
      this.jitter = { delay: s.jitterBufferDelay ?? 0, emitted: s.jitterBufferEmittedCount ?? 0 };
    }
  }

  _emit() {
    this.onState({ state: this.state, rate: 1, framesSkipped: 0, ...this.stats });
  }
}
