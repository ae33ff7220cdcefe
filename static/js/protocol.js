// The session WebSocket's binary chunk frame:
//   4-byte big-endian unsigned N | N bytes of UTF-8 JSON header | the frames' bytes concatenated
// where header.frames lists each payload's byte length. A JPEG chunk's payloads are its frames (each
// one image of header.mime); an H.264 chunk (header.codec "h264", header.mime the MP4 MIME with its
// codecs) has one fMP4 fragment, preceded by the init segment when header.init is true.

const decoder = new TextDecoder("utf-8");

export class FrameFormatError extends Error {}

export function parseChunkFrame(buffer) {
  if (!(buffer instanceof ArrayBuffer) || buffer.byteLength < 4) {
    throw new FrameFormatError("chunk frame shorter than its length prefix");
  }
  const view = new DataView(buffer);
  const headerLength = view.getUint32(0, false);
  if (4 + headerLength > buffer.byteLength) throw new FrameFormatError("chunk header runs past the frame");
  let header;
  try {
    header = JSON.parse(decoder.decode(new Uint8Array(buffer, 4, headerLength)));
  } catch (err) {
    throw new FrameFormatError(`chunk header is not JSON: ${err.message}`);
  }
  if (!header || header.type !== "chunk" || !Array.isArray(header.frames)) {
    throw new FrameFormatError("chunk header lacks type=chunk or a frames list");
  }
  const frames = [];
  let offset = 4 + headerLength;
  for (const length of header.frames) {
    if (!Number.isInteger(length) || length < 0 || offset + length > buffer.byteLength) {
      throw new FrameFormatError("frame lengths do not match the frame's size");
    }
    frames.push(new Uint8Array(buffer, offset, length));
    offset += length;
  }
  return { header, frames };
}
