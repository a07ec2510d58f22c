// A run shaped like a Hugging Face causal LM, as the Python client reports one:
// modules `model.embed_tokens`, `model.layers.N.…`, `model.norm`, `lm_head`, each
// in its group (the groups share the `model.` prefix of their modules), norm weights
// with drift and update norm, and a constant lr. In bf16 at lr 1e-5 the norm weights
// freeze (every update rounds away), as they did in the walkthrough.
//
// Run on its own to make both runs on a server: `node hf_run.mjs http://127.0.0.1:PORT`.

const LAYERS = 4;

function modules() {
  const out = [{ module: "model.embed_tokens", group: "model.embed_tokens", role: "embedding" }];
  for (let l = 0; l < LAYERS; l++) {
    const layer = `model.layers.${l}`;
    out.push({ module: `${layer}.input_layernorm`, group: "model.layers", role: "norm" });
    for (const p of ["q_proj", "k_proj", "v_proj", "o_proj"]) {
      out.push({ module: `${layer}.self_attn.${p}`, group: "model.layers", role: "linear" });
    }
    out.push({ module: `${layer}.post_attention_layernorm`, group: "model.layers", role: "norm" });
    for (const p of ["gate_proj", "up_proj", "down_proj"]) {
      out.push({ module: `${layer}.mlp.${p}`, group: "model.layers", role: "linear" });
    }
  }
  out.push({ module: "model.norm", group: "model.norm", role: "norm" });
  out.push({ module: "lm_head", group: "lm_head", role: "linear" });
  return out;
}

/** Registers run `id` in `dtype` ("f32" or "bf16") and sends `steps` steps. */
export async function makeHfRun(base, id, dtype, steps = 120) {
  const call = async (path, body, method = "POST") => {
    const response = await fetch(base + path, {
      method,
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status} ${await response.text()}`);
  };
  const all = modules();
  const lr = dtype === "bf16" ? 1e-5 : 1e-3;
  await call(
    `/api/v1/runs/${id}`,
    {
      name: `HF-shaped ${dtype}`,
      precision: { param_dtype: dtype, loss_scaler: "none" },
      optimizer: { name: "adamw", lr },
      params: all.map((m) => ({ name: `${m.module}.weight`, module: m.module, group: m.group, role: m.role, dtype, shape: [64] })),
    },
    "PUT",
  );
  const frozen = dtype === "bf16";
  const records = [];
  for (let s = 0; s < steps; s++) {
    records.push({
      step: s,
      loss: 4 - 1.5 * (s / steps) + 0.05 * Math.sin(s),
      lr,
      modules: all.map((m, i) => ({ module: m.module, grad_norm: 0.02 * (1 + i / 10) * (1 + 0.3 * Math.sin(s / 7 + i)), hook_hits: 1 })),
      params: all
        .filter((m) => m.role === "norm")
        .map((m) => ({
          name: `${m.module}.weight`,
          grad_norm: 3e-3,
          update_norm: frozen ? 0 : lr * (1 + 0.2 * Math.cos(s / 9)),
          drift: frozen ? 0 : lr * Math.sqrt(s + 1),
          mean: 1.0,
        })),
    });
  }
  await call(`/api/v1/runs/${id}/steps`, records);
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const base = process.argv[2];
  await makeHfRun(base, "hf-f32", "f32");
  await makeHfRun(base, "hf-bf16", "bf16");
  console.log(`${base}/runs/hf-f32 ${base}/runs/hf-bf16`);
}
