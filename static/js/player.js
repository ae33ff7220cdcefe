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

export class StreamPlayer {
  constructor(canvas, { prebufferChunks = 1, maxBufferChunks = 4, maxSlowdown = 1.5, onState = () => {} } = {}) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.prebufferChunks = prebufferChunks;
    this.maxBufferChunks = maxBufferChunks;
    this.maxSlowdown = maxSlowdown;
    this.onState = onState;
    this.fps = 16;
    this.framesPerChunk = 12;
    this.reset();
    this._tick = this._tick.bind(this);
    this._raf = requestAnimationFrame(this._tick);
  }

  reset() {
    for (const frame of this.queue || []) frame.bitmap.close();
    this.queue = [];
    this.decodeChain = Promise.resolve();
    this.lastQueuedIndex = -1;
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
    if (fps) this.fps = fps;
    if (framesPerChunk) this.framesPerChunk = framesPerChunk;
    if (width && height && (this.canvas.width !== width || this.canvas.height !== height)) {
      this.canvas.width = width;
      this.canvas.height = height;
    }
  }

  get frameMs() {
    return 1000 / this.fps;
  }

  get chunkMs() {
    return this.framesPerChunk * this.frameMs;
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
    this._emit();
  }

  _emit() {
    this.onState({ state: this.state, bufferedFrames: this.queue.length, rate: this.rate, ...this.stats });
  }
}
