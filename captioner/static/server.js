// Where `captioner serve`'s page gets its captions: the server's API (captioner/serve.py). Served as ./source.js
// (captioner/static/page.js says what a source is).

export function description() {
  return "";
}

export async function caption(blob, name, beamSize) {
  const form = new FormData();
  form.append("image", blob, name);
  form.append("beam_size", String(beamSize));
  const response = await fetch("api/caption", { method: "POST", body: form });
  const answer = await response.json();
  if (!response.ok) throw new Error(answer.error || response.statusText);
  return answer;
}

export async function examples() {
  return (await fetch("api/examples")).json();
}
