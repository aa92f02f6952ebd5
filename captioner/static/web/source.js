// Where an exported page (`captioner export --format web`) gets its captions: the model's graphs on ONNX Runtime Web,
// in this browser, with no server behind the page. Served as ./source.js (captioner/static/page.js says what a source
// is). What captioner/onnx/runtime.py does in Python, done here: the image squashed to the model's square input,
// the encoder, the start of the search, and the search's host loop (./search.js) over the word graphs.
import * as ort from "onnxruntime-web";
import { beamSearch, greedySearch } from "./search.js";

const GRAPHS = ["encoder", "start", "greedy", "beam"];
// Threads need SharedArrayBuffer, which a browser gives only a cross-origin isolated page.
const THREADS = globalThis.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
ort.env.wasm.numThreads = THREADS;
ort.env.logLevel = "error"; // the graph optimiser's notes on nodes it leaves as they are are not the visitor's

let loading = null; // the sessions, made at the first caption

async function json(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: ${response.status} ${response.statusText}`);
  return response.json();
}

async function bytes(url, integrity) {
  const response = await fetch(url, integrity ? { integrity } : {});
  if (!response.ok) throw new Error(`${url}: ${response.status} ${response.statusText}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function load() {
  const [site, config] = await Promise.all([json("site.json"), json("captioner.json")]);
  ort.env.wasm.wasmBinary = await bytes(site.ort.wasm.url, site.ort.wasm.integrity);
  // weights.bin holds the weights that several graphs read: fetched once, handed to each graph that reads it
  const weights = site.external.length ? await bytes(site.weights) : null;
  const sessions = {};
  for (const graph of GRAPHS) {
    const externalData = site.external.includes(graph) ? [{ path: site.weights, data: weights }] : [];
    sessions[graph] = await ort.InferenceSession.create(`${graph}.onnx`, {
      executionProviders: ["wasm"], graphOptimizationLevel: "all", logSeverityLevel: 3, externalData,
    });
  }
  return { site, config, sessions };
}

export function description() {
  const threads = THREADS > 1 ? `${THREADS} threads (the page is cross-origin isolated)`
    : "one thread (the page is not cross-origin isolated: served with the headers Cross-Origin-Opener-Policy: " +
      "same-origin and Cross-Origin-Embedder-Policy: require-corp, it would use several)";
  return `Captioned in this browser, by ONNX Runtime Web (WebAssembly, SIMD) on ${threads}. No image leaves it.`;
}

// A word graph's session for one batch, as ./search.js uses it: the inputs every call reads stay bound as
// tensors, and each call's state is the last call's outputs, the tensors ONNX Runtime returned.
class Words {
  constructor(session, fixed) {
    this.session = session;
    this.fixed = {};
    this.bind(fixed);
  }

  tensor(type, data, dims) {
    return new ort.Tensor(type, data, dims);
  }

  bind(fixed) {
    Object.assign(this.fixed, fixed);
  }

  async call(state) {
    return this.session.run({ ...this.fixed, ...state });
  }
}

// The image squashed to the model's square input (size x size), as uint8 channels first: (1, 3, size, size).
async function pixels(blob, name, size) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(blob, { colorSpaceConversion: "none", premultiplyAlpha: "none" });
  } catch {
    throw new Error(`${name}: not an image file this browser can read`);
  }
  const canvas = new OffscreenCanvas(size, size), context = canvas.getContext("2d");
  context.imageSmoothingEnabled = true;
  context.imageSmoothingQuality = "high";
  context.drawImage(bitmap, 0, 0, size, size);
  const rgba = context.getImageData(0, 0, size, size).data, area = size * size;
  const planes = new Uint8Array(3 * area);
  for (let i = 0; i < area; i++) {
    for (let channel = 0; channel < 3; channel++) planes[channel * area + i] = rgba[4 * i + channel];
  }
  return new ort.Tensor("uint8", planes, [1, 3, size, size]);
}

// Word ids -> words, stopping at <end> and skipping <pad> and <start>; and the text, its words joined by spaces but
// between two characters of an unspaced script (captioner.onnx.runtime.Captioner.words and text).
function words(config, ids) {
  const kept = [];
  for (const id of ids) {
    if (id === config.end_index) break;
    if (id !== config.pad_index && id !== config.start_index) kept.push(id);
  }
  const unspaced = new Set(config.unspaced);
  const text = kept.map((id, i) => (i > 0 && !(unspaced.has(kept[i - 1]) && unspaced.has(id)) ? " " : "") +
    config.vocab[id]).join("");
  return { tokens: kept.map((id) => config.vocab[id]), text };
}

export async function caption(blob, name, beamSize) {
  loading ??= load().catch((err) => {
    loading = null;
    throw new Error(`the model did not load: ${err.message}`);
  });
  const { config, sessions } = await loading;
  const images = await pixels(blob, name, config.image_size);
  const { annotations } = await sessions.encoder.run({ images });
  const { h, c, keys } = await sessions.start.run({ annotations });
  const common = { start: config.start_index, pad: config.pad_index, n: config.words, maxLen: config.max_len };
  const out = beamSize === 1
    ? await greedySearch(new Words(sessions.greedy, { annotations, keys }), annotations, keys, h, c, common)
    : await beamSearch(new Words(sessions.beam, { annotations, keys }), annotations, keys, h, c,
      { ...common, vocabSize: config.vocab.length, beamSize, lengthPenalty: config.length_penalty });
  const { tokens, text } = words(config, out.ids[0]);
  return {
    caption: text,
    tokens,
    score: out.scores[0],
    grid: config.grid,
    alphas: out.alphas[0].slice(0, tokens.length).map((row) => Array.from(row)),
  };
}

export async function examples() {
  return (await json("site.json")).examples;
}
