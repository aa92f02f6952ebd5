// The captioner's page: an image in (chosen, dropped or pasted), its caption out, and each word's attention drawn over
// it. One page for `captioner serve` and for `captioner export --format web`: they differ only in ./source.js, where a
// caption comes from (captioner/static/server.js: the server's API; captioner/static/web/source.js: the exported
// graphs on ONNX Runtime Web, in this browser). A source's `caption(blob, name, beamSize)` answers as the API does
// ({caption, tokens, score, grid, alphas}) or throws an Error whose message is one line for the page.
import { caption as captionOf, description, examples } from "./source.js";

const FLOOR = 0.2;  // the least-attended pixels keep 20% of their brightness, as in `captioner caption --overlays`
const $ = (id) => document.getElementById(id);
let picture = null, result = null, selected = 0;

function attentionLayer(row, grid, alphaMax) {
  // One h x w canvas, black where attention is low: drawn scaled up (smoothly) over the image.
  const [h, w] = grid, layer = document.createElement("canvas");
  layer.width = w; layer.height = h;
  const ctx = layer.getContext("2d"), pixels = ctx.createImageData(w, h);
  row.forEach((a, i) => { pixels.data[4 * i + 3] = 255 * (1 - FLOOR) * (1 - Math.min(a / alphaMax, 1)); });
  ctx.putImageData(pixels, 0, 0);
  return layer;
}

function shape(canvas, side) {
  // The picture's aspect ratio, `side` pixels on its longer side (shown at half that): the attention grid covers the
  // whole image, which the model saw squashed to a square, so it is stretched back over the image as it is.
  const wide = picture.width >= picture.height, ratio = picture.height / picture.width;
  canvas.width = wide ? side : Math.max(1, Math.round(side / ratio));
  canvas.height = wide ? Math.max(1, Math.round(side * ratio)) : side;
  canvas.style.width = `${canvas.width / 2}px`; canvas.style.height = `${canvas.height / 2}px`;
}

function draw(canvas, index) {
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = true; ctx.imageSmoothingQuality = "high";
  ctx.drawImage(picture, 0, 0, canvas.width, canvas.height);
  if (index !== null) ctx.drawImage(result.layers[index], 0, 0, canvas.width, canvas.height);
}

function select(index) {
  selected = index;
  draw($("big"), index);
  $("big-word").textContent = result.tokens[index];
  document.querySelectorAll("#strip figure").forEach((f, i) => f.classList.toggle("selected", i === index));
}

function show(answer) {
  result = answer;
  const alphaMax = Math.max(...answer.alphas.flat(), 1e-6);
  result.layers = answer.alphas.map((row) => attentionLayer(row, answer.grid, alphaMax));
  shape($("big"), 672);
  $("caption").textContent = answer.caption;
  $("score").textContent = answer.score.toFixed(3);
  $("alpha-max").textContent = alphaMax.toFixed(3);
  const bar = $("bar").getContext("2d"), gradient = bar.createLinearGradient(0, 0, 200, 0);
  gradient.addColorStop(0, `rgb(${255 * FLOOR},${255 * FLOOR},${255 * FLOOR})`);
  gradient.addColorStop(1, "white");
  bar.fillStyle = gradient; bar.fillRect(0, 0, 200, 12);
  const strip = $("strip");
  strip.replaceChildren();
  answer.tokens.forEach((word, i) => {
    const figure = document.createElement("figure"), canvas = document.createElement("canvas");
    const label = document.createElement("figcaption");
    shape(canvas, 224);
    label.textContent = word;
    figure.append(canvas, label);
    figure.addEventListener("mouseenter", () => { draw($("big"), i); $("big-word").textContent = word; });
    figure.addEventListener("mouseleave", () => select(selected));
    figure.addEventListener("click", () => select(i));
    strip.append(figure);
    draw(canvas, i);
  });
  $("view").hidden = false;
  select(0);
}

async function caption(blob, name) {
  $("error").textContent = ""; $("status").textContent = "captioning…";
  try {
    const answer = await captionOf(blob, name, Number($("beam").value));
    picture = await createImageBitmap(blob);
    show(answer);
    $("status").textContent = "";
  } catch (err) {
    $("status").textContent = "";
    $("error").textContent = err.message;
    $("caption").textContent = ""; $("strip").replaceChildren(); $("view").hidden = true;
  }
}

$("file").addEventListener("change", (e) => { const f = e.target.files[0]; if (f) caption(f, f.name); e.target.value = ""; });
$("drop").addEventListener("click", (e) => { if (e.target === $("drop")) $("file").click(); });
$("drop").addEventListener("dragover", (e) => { e.preventDefault(); $("drop").classList.add("over"); });
$("drop").addEventListener("dragleave", () => $("drop").classList.remove("over"));
$("drop").addEventListener("drop", (e) => {
  e.preventDefault(); $("drop").classList.remove("over");
  const f = e.dataTransfer.files[0]; if (f) caption(f, f.name);
});
document.addEventListener("paste", (e) => {
  const f = [...e.clipboardData.files].find((file) => file.type.startsWith("image/"));
  if (f) caption(f, f.name || "pasted.png");
});
$("runtime").textContent = description();
examples().then((names) => names.forEach((name) => {
  const img = document.createElement("img");
  img.src = `examples/${name}`; img.alt = img.title = name;
  img.addEventListener("click", async () => caption(await (await fetch(img.src)).blob(), name));
  $("examples").append(img);
}));
