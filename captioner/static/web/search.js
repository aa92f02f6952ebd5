// The searches' host loop in the browser: captioner/models/search_host.py (the record, finishing, leaving, the
// read-back along the parents) and captioner/onnx/search.py (the loop over the exported word graphs), translated line
// for line. Every choice of words is inside the graphs; this file only loops, lets finished images leave the batch and
// reads the captions back. tests/test_web.py runs it under Node against the Python loop, call by call.
//
// A tensor here is what ONNX Runtime Web's are: `{type, data, dims}`, data a typed array (int64: BigInt64Array,
// bool: Uint8Array). `words` is a word graph's session for one batch: `words.call(state)` runs one call and returns
// its outputs by name, `words.bind(fixed)` sets the inputs every call reads, `words.tensor(type, data, dims)` makes
// a tensor.

export class SearchError extends Error {}

const STATE = ["tokens", "h", "c", "scores", "lengths", "finished"];

function size(dims) {
  return dims.reduce((a, b) => a * b, 1);
}

// The rows of `tensor` (along its first axis) where `keep` is true.
export function gather(words, tensor, keep) {
  const row = size(tensor.dims.slice(1));
  const rows = keep.reduce((n, k) => n + (k ? 1 : 0), 0);
  const data = new tensor.data.constructor(rows * row);
  let at = 0;
  keep.forEach((k, i) => {
    if (k) data.set(tensor.data.subarray(i * row, (i + 1) * row), at++ * row);
  });
  return words.tensor(tensor.type, data, [rows, ...tensor.dims.slice(1)]);
}

// Columns [0, m) of an (A, n, ...) tensor, as a flat array of (A, m, ...).
function firstColumns(tensor, m) {
  const [A, n] = tensor.dims, inner = size(tensor.dims.slice(2));
  const data = new tensor.data.constructor(A * m * inner);
  for (let a = 0; a < A; a++) data.set(tensor.data.subarray(a * n * inner, (a * n + m) * inner), a * m * inner);
  return data;
}

// Column j of an (A, n) tensor.
function column(tensor, j) {
  const [A, n] = tensor.dims;
  return Array.from({ length: A }, (_, a) => tensor.data[a * n + j]);
}

export class GreedyRecord {
  constructor(images, cells, maxLen, pad = 0) {
    this.maxLen = maxLen;
    this.cells = cells;
    this.written = 0;
    this.rows = Array.from({ length: images }, (_, i) => i); // the captions still being written
    this.ids = Array.from({ length: images }, () => new Array(maxLen).fill(pad));
    this.alphas = Array.from({ length: images }, () => new Float32Array(maxLen * cells));
    this.scores = new Array(images).fill(0);
    this.lengths = new Array(images).fill(0);
  }

  room(words) {
    return Math.min(words, this.maxLen - this.written);
  }

  // A call's words (A*m) and their attention (A*m*P), and each caption's score and length after them (A).
  write(ids, alphas, scores, lengths, m) {
    const P = this.cells;
    this.rows.forEach((row, a) => {
      for (let j = 0; j < m; j++) this.ids[row][this.written + j] = Number(ids[a * m + j]);
      this.alphas[row].set(alphas.subarray(a * m * P, (a + 1) * m * P), this.written * P);
      this.scores[row] = scores[a];
      this.lengths[row] = Number(lengths[a]);
    });
    this.written += m;
  }

  over(finished) {
    return this.written === this.maxLen || finished.every(Boolean);
  }

  leave(finished) {
    if (!finished.some(Boolean)) return null;
    const keep = Array.from(finished, (f) => !f);
    this.rows = this.rows.filter((_, a) => keep[a]);
    return keep;
  }

  result() {
    const P = this.cells;
    return {
      ids: this.ids.map((ids, b) => ids.slice(0, this.lengths[b])),
      scores: this.scores,
      alphas: this.alphas.map((alphas, b) =>
        Array.from({ length: this.lengths[b] }, (_, t) => alphas.slice(t * P, (t + 1) * P)),
      ),
    };
  }
}

export class BeamRecord {
  constructor(images, beams, cells, maxLen, pad = 0) {
    Object.assign(this, { images, beams, cells, maxLen, written: 0 });
    this.alive = Array.from({ length: images }, (_, i) => i); // the images still searching
    this.ids = new Array(maxLen * images * beams).fill(pad);
    this.parents = Array.from({ length: maxLen * images * beams }, (_, i) => i % beams);
    this.alphas = new Float32Array(maxLen * images * beams * cells);
    this.winner = new Array(images).fill(0);
    this.scores = new Array(images).fill(0);
    this.lengths = new Array(images).fill(0);
  }

  room(words) {
    return Math.min(words, this.maxLen - this.written);
  }

  // A call's m words for the A images still searching: words and parents (m*A*K), attention (m*A*K*P).
  write(ids, parents, alphas, m) {
    const { images, beams: K, cells: P } = this, A = this.alive.length;
    for (let j = 0; j < m; j++) {
      this.alive.forEach((image, a) => {
        for (let k = 0; k < K; k++) {
          const from = (j * A + a) * K + k, to = ((this.written + j) * images + image) * K + k;
          this.ids[to] = Number(ids[from]);
          this.parents[to] = Number(parents[from]);
          this.alphas.set(alphas.subarray(from * P, (from + 1) * P), to * P);
        }
      });
    }
    this.written += m;
  }

  over(done) {
    return this.written === this.maxLen || done.every(Boolean);
  }

  finish(winner, score, length) {
    this.alive.forEach((image, a) => {
      this.winner[image] = Number(winner[a]);
      this.scores[image] = score[a];
      this.lengths[image] = Number(length[a]);
    });
  }

  leave(done, winner, score, length) {
    if (!done.some(Boolean)) return null;
    this.alive.forEach((image, a) => {
      if (!done[a]) return;
      this.winner[image] = Number(winner[a]);
      this.scores[image] = score[a];
      this.lengths[image] = Number(length[a]);
    });
    const keep = done.map((d) => !d);
    this.alive = this.alive.filter((_, a) => keep[a]);
    return keep;
  }

  // Each image's winner read back along the parents, from its last word to its first.
  result() {
    const { images, beams: K, cells: P } = this;
    const ids = [], alphas = [];
    for (let image = 0; image < images; image++) {
      let beam = this.winner[image];
      const words = new Array(this.written), maps = new Array(this.written);
      for (let step = this.written - 1; step >= 0; step--) {
        const at = (step * images + image) * K + beam;
        words[step] = this.ids[at];
        maps[step] = this.alphas.slice(at * P, (at + 1) * P);
        beam = this.parents[at];
      }
      ids.push(words.slice(0, this.lengths[image]));
      alphas.push(maps.slice(0, this.lengths[image]));
    }
    return { ids, scores: this.scores, alphas };
  }
}

// The state for the next call: the outputs as they are, or, when images leave, the rows `keep` of each.
function nextState(words, out, keep) {
  return Object.fromEntries(STATE.map((name) => {
    const value = out[`${name}_out`];
    return [name, keep === null ? value : gather(words, value, keep)];
  }));
}

export async function greedySearch(words, annotations, keys, h, c, { start, n, pad = 0, maxLen = 30 }) {
  if (maxLen < 1) throw new SearchError(`max_len must be >= 1, got ${maxLen}`);
  const [B, P] = annotations.dims;
  let state = {
    tokens: words.tensor("int64", new BigInt64Array(B).fill(BigInt(start)), [B]),
    h, c,
    scores: words.tensor("float32", new Float32Array(B), [B]),
    lengths: words.tensor("int64", new BigInt64Array(B), [B]),
    finished: words.tensor("bool", new Uint8Array(B), [B]),
  };
  const record = new GreedyRecord(B, P, maxLen, pad);
  for (;;) {
    const out = await words.call(state);
    const m = record.room(n);
    record.write(firstColumns(out.words, m), firstColumns(out.alphas, m), column(out.word_scores, m - 1),
      column(out.word_lengths, m - 1), m);
    const finished = Array.from(out.finished_out.data, Boolean);
    if (record.over(finished)) return record.result();
    const keep = record.leave(finished);
    if (keep !== null) {
      annotations = gather(words, annotations, keep);
      keys = gather(words, keys, keep);
      words.bind({ annotations, keys });
    }
    state = nextState(words, out, keep);
  }
}

// `K` copies of each row of an (B, D) tensor: (B, K, D).
function repeat(words, tensor, K) {
  const [B, D] = tensor.dims, data = new tensor.data.constructor(B * K * D);
  for (let b = 0; b < B; b++) {
    for (let k = 0; k < K; k++) data.set(tensor.data.subarray(b * D, (b + 1) * D), (b * K + k) * D);
  }
  return words.tensor(tensor.type, data, [B, K, D]);
}

export async function beamSearch(words, annotations, keys, h, c, options) {
  const { start, n, vocabSize, pad = 0, beamSize: K = 3, maxLen = 30, lengthPenalty = 1.0 } = options;
  if (K < 1 || maxLen < 1) throw new SearchError(`beam_size and max_len must be >= 1, got ${K} and ${maxLen}`);
  if (vocabSize - 2 < K) {
    throw new SearchError(
      `beam size ${K} is larger than the ${vocabSize - 2} words this vocabulary can generate (of ${vocabSize})`);
  }
  const [B, P] = annotations.dims;
  const scores = new Float32Array(B * K).map((_, i) => (i % K === 0 ? 0 : -Infinity));
  let state = {
    tokens: words.tensor("int64", new BigInt64Array(B * K).fill(BigInt(start)), [B, K]),
    h: repeat(words, h, K),
    c: repeat(words, c, K),
    scores: words.tensor("float32", scores, [B, K]),
    lengths: words.tensor("int64", new BigInt64Array(B * K), [B, K]),
    finished: words.tensor("bool", new Uint8Array(B * K), [B, K]),
  };
  words.bind({ length_penalty: words.tensor("float32", new Float32Array([lengthPenalty]), []) });
  const record = new BeamRecord(B, K, P, maxLen, pad);
  for (;;) {
    const out = await words.call(state);
    const m = record.room(n);
    const A = out.finished_out.dims[0];
    record.write(out.words.data.subarray(0, m * A * K), out.parents.data.subarray(0, m * A * K),
      out.alphas.data.subarray(0, m * A * K * P), m);
    const best = ["winner", "winner_score", "winner_length"].map((name) =>
      Array.from(out[name].data.subarray((m - 1) * A, m * A)));
    const finished = out.finished_out.data;
    const done = Array.from({ length: A }, (_, a) => finished.subarray(a * K, (a + 1) * K).every(Boolean));
    if (record.over(done)) {
      record.finish(...best);
      return record.result();
    }
    const keep = record.leave(done, ...best);
    if (keep !== null) {
      annotations = gather(words, annotations, keep);
      keys = gather(words, keys, keep);
      words.bind({ annotations, keys });
    }
    state = nextState(words, out, keep);
  }
}
