"""Reference values for the Rust Qwen2 from Hugging Face transformers.

Builds transformers' Qwen2ForCausalLM from the tiny checkpoint in tiny-qwen2/
(written by `cargo run -p gradflow-trainer --example reference_checkpoint`), runs
the fixed batch below in float32 with eager attention, and writes fixture.json:
the logits, the causal-LM loss (mean next-token cross-entropy, what `labels=ids`
computes) and every parameter's gradient norm, by HF name. The Rust test
trainer-client/tests/trainer/reference.rs recomputes them and compares.

    python3 tests/reference/generate.py   # needs torch and transformers
"""
import json
import pathlib

import torch
import transformers
from transformers import Qwen2ForCausalLM

HERE = pathlib.Path(__file__).parent
# Two sequences of 12 token ids, below the tiny vocabulary's 320.
IDS = [
    [1, 118, 112, 105, 116, 36, 120, 108, 105, 36, 107, 118],
    [1, 120, 118, 101, 114, 115, 116, 115, 119, 105, 36, 119],
]


def main() -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(
        HERE / "tiny-qwen2", torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.train(False)
    ids = torch.tensor(IDS)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grad_norms = {
        name: float(p.grad.norm()) for name, p in model.named_parameters() if p.grad is not None
    }
    fixture = {
        "generated_by": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "ids": IDS,
        "loss": float(out.loss.detach()),
        "logits_shape": list(out.logits.shape),
        "logits": [round(float(x), 7) for x in out.logits.flatten()],
        "grad_norms": grad_norms,
    }
    (HERE / "fixture.json").write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote fixture.json: loss {fixture['loss']:.6f}, {len(grad_norms)} gradients")


if __name__ == "__main__":
    main()
