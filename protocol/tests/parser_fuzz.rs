//! Property tests of the protocol's parsers, run in CI with a fixed case budget:
//! no input makes them panic, a broken valid body is rejected with a path inside the
//! body, and valid batches read back exactly as written, in JSON and in CBOR.

// A test may be one long table of cases: the 150-line limit is production code's.
#![allow(clippy::too_many_lines)]

use gradflow_protocol::{
    Float, InvalidBody, ModuleStep, RunRegistration, StepRecord, parse_steps_cbor,
    parse_steps_json, parse_steps_ndjson, to_cbor,
};
use proptest::prelude::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // Failures are reported with the seed; nothing is written next to the tests.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A valid batch: increasing steps, losses that may be non-finite, modules with
/// gradients that may be null (not reached), zero or NaN.
fn batch() -> impl Strategy<Value = Vec<StepRecord>> {
    let value = prop_oneof![
        4 => (0.0f64..1e6).prop_map(Some),
        1 => Just(Some(0.0)),
        // Written by CBOR encoders as half and single floats (their shortest exact form).
        1 => Just(Some(0.5)),
        1 => Just(Some(16_777_216.0)),
        1 => Just(Some(f64::NAN)),
        1 => Just(Some(f64::INFINITY)),
        1 => Just(None),
    ];
    let module = (
        "[a-z]{1,8}(\\.[a-z0-9_]{1,8}){0,3}",
        value.clone(),
        proptest::option::of(0u32..4),
    )
        .prop_map(|(module, grad, hits)| ModuleStep {
            module,
            grad_norm: grad.map(Float),
            hook_hits: hits,
            ..Default::default()
        });
    let record = (value, proptest::collection::vec(module, 0..6));
    (
        0u64..1_000_000,
        proptest::collection::vec((1u64..1000, record), 1..8),
    )
        .prop_map(|(start, records)| {
            let mut step = start;
            records
                .into_iter()
                .map(|(gap, (loss, modules))| {
                    step += gap;
                    let mut modules = modules;
                    modules.sort_by(|a, b| a.module.cmp(&b.module));
                    modules.dedup_by(|a, b| a.module == b.module);
                    StepRecord {
                        step,
                        loss: loss.map(Float),
                        modules,
                        ..StepRecord::default()
                    }
                })
                .collect()
        })
}

/// Equal as the server stores them: numbers as `f32` (NaN equal to NaN). serde_json's
/// default float parsing is fast but not always correctly rounded (it can be 1 ulp
/// of `f64` off, e.g. for 978783.7085180081); every value is stored as `f32`, so
/// that is the precision a read-back promises.
fn same(a: &[StepRecord], b: &[StepRecord]) -> bool {
    let nan_safe = |x: Option<Float>| {
        x.map(|f| {
            if f.0.is_nan() {
                u32::MAX
            } else {
                (f.0 as f32).to_bits()
            }
        })
    };
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.step == y.step
                && nan_safe(x.loss) == nan_safe(y.loss)
                && x.modules.len() == y.modules.len()
                && x.modules.iter().zip(&y.modules).all(|(m, n)| {
                    m.module == n.module
                        && m.hook_hits == n.hook_hits
                        && nan_safe(m.grad_norm) == nan_safe(n.grad_norm)
                })
        })
}

proptest! {
    #![proptest_config(config(2_000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_steps_json(&bytes);
        let _ = parse_steps_ndjson(&bytes);
        let _ = parse_steps_cbor(&bytes);
        let _ = RunRegistration::from_json(&bytes);
        let _ = RunRegistration::from_cbor(&bytes);
    }

    #[test]
    fn json_like_text_never_panics(text in "[\\[\\]{}\":,0-9a-zA-Z._ \\-\\n]{0,256}") {
        let _ = parse_steps_json(text.as_bytes());
        let _ = parse_steps_ndjson(text.as_bytes());
        let _ = RunRegistration::from_json(text.as_bytes());
    }
}

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn valid_batches_read_back_as_written(records in batch()) {
        let json = serde_json::to_vec(&records).unwrap();
        let parsed = parse_steps_json(&json).unwrap();
        prop_assert!(same(&parsed, &records));
        let ndjson: Vec<u8> = records
            .iter()
            .flat_map(|r| {
                let mut line = serde_json::to_vec(r).unwrap();
                line.push(b'\n');
                line
            })
            .collect();
        prop_assert!(same(&parse_steps_ndjson(&ndjson).unwrap(), &records));
        // CBOR as a Rust client writes it. The fast decoder must read it by itself:
        // a body only the reference decoder (ciborium) reads would be parsed twice.
        let cbor = to_cbor(&records);
        prop_assert!(same(&parse_steps_cbor(&cbor).unwrap(), &records));
        let fast: Vec<StepRecord> = minicbor_serde::from_slice(&cbor).unwrap();
        prop_assert!(same(&fast, &records));
    }

    #[test]
    fn a_cut_or_corrupted_batch_is_an_error_with_a_path(
        records in batch(),
        cut in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let json = serde_json::to_vec(&records).unwrap();
        cut_or_corrupted(&json, cut.index(json.len()), byte, parse_steps_json)?;
    }

    #[test]
    fn a_cut_or_corrupted_cbor_batch_is_an_error_with_a_path(
        records in batch(),
        cut in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let cbor = to_cbor(&records);
        cut_or_corrupted(&cbor, cut.index(cbor.len()), byte, parse_steps_cbor)?;
    }
}

/// `body` (a valid batch) cut at `at` is an error with a path inside the body (JSON
/// loses its closing bracket, CBOR its whole data item); with the byte at `at`
/// replaced by `byte` it is either still valid or such an error.
fn cut_or_corrupted(
    body: &[u8],
    at: usize,
    byte: u8,
    parse: fn(&[u8]) -> Result<Vec<StepRecord>, InvalidBody>,
) -> Result<(), TestCaseError> {
    let error = parse(&body[..at]).unwrap_err();
    prop_assert!(error.path.starts_with("steps"), "path {:?}", error.path);
    prop_assert!(!error.message.is_empty());
    let mut corrupted = body.to_vec();
    corrupted[at] = byte;
    if let Err(error) = parse(&corrupted) {
        prop_assert!(error.path.starts_with("steps"), "path {:?}", error.path);
        prop_assert!(!error.message.is_empty());
    }
    Ok(())
}
