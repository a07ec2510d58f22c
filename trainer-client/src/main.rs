//! `gradflow-trainer`: the instrumented Qwen2 + agent trainer. Not built yet; this
//! binary only says so, so that nobody mistakes it for a working client.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!(
        "gradflow-trainer {}: the instrumented trainer is not implemented yet; \
         stream steps with any HTTP client as README.md shows",
        env!("CARGO_PKG_VERSION")
    );
    ExitCode::FAILURE
}
