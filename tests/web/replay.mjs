// Runs captioner/static/web/search.js's host loop on searches the Python host loop ran (tests/test_web.py): each
// call's inputs (the state, and what is bound) must be the very ones the Python loop gave its graph, and each call
// returns what the graph returned to it. Reads the searches as JSON on stdin; writes each one's captions, or the
// first input that differs, as JSON on stdout.
import { beamSearch, greedySearch } from "../../captioner/static/web/search.js";

const TYPES = { float32: Float32Array, int64: BigInt64Array, bool: Uint8Array };

function decode({ type, dims, data }) {
  const bytes = Buffer.from(data, "base64");
  const copy = new Uint8Array(bytes).buffer; // aligned
  return { type, dims, data: new TYPES[type](copy) };
}

function same(got, want) {
  return got.type === want.type && JSON.stringify(got.dims) === JSON.stringify(want.dims) &&
    got.data.length === want.data.length && got.data.every((x, i) => Object.is(x, want.data[i]));
}

class Replay {
  constructor(calls) {
    this.calls = calls;
    this.fixed = {};
    this.made = 0;
  }

  tensor(type, data, dims) {
    return { type, data, dims };
  }

  bind(fixed) {
    Object.assign(this.fixed, fixed);
  }

  async call(state) {
    const call = this.calls.shift();
    if (call === undefined) throw new Error("a call more than the Python loop made");
    const feed = { ...state, ...this.fixed };
    for (const [name, encoded] of Object.entries(call.inputs)) {
      if (!same(feed[name], decode(encoded))) throw new Error(`input ${name} differs from Python's`);
    }
    return Object.fromEntries(Object.entries(call.outputs).map(([name, x]) => [name, decode(x)]));
  }
}

const searches = JSON.parse(await new Promise((resolve) => {
  let text = "";
  process.stdin.on("data", (chunk) => { text += chunk; });
  process.stdin.on("end", () => resolve(text));
}));
const results = [];
for (const search of searches) {
  const words = new Replay(search.calls);
  const [annotations, keys, h, c] = ["annotations", "keys", "h", "c"].map((name) => decode(search[name]));
  words.bind({ annotations, keys });
  try {
    const out = search.beam_size === 1
      ? await greedySearch(words, annotations, keys, h, c, search.options)
      : await beamSearch(words, annotations, keys, h, c, { ...search.options, beamSize: search.beam_size });
    const left = words.calls.length;
    results.push(left ? { error: `${left} calls fewer than the Python loop made` } :
      { ids: out.ids, scores: out.scores, alphas: out.alphas.map((rows) => rows.map((row) => Array.from(row))) });
  } catch (err) {
    results.push({ error: err.message });
  }
}
process.stdout.write(JSON.stringify(results));
