//! Parsing step batches, JSON, NDJSON or CBOR, with error paths (`crate::located`).

use serde::Serialize;

use crate::error::InvalidBody;
use crate::located::{bounded_cbor_with_path, json_with_path};
use crate::step::{StepRecord, validate_batch};

/// Parses and validates a JSON array of step records (`application/json`).
pub fn parse_steps_json(body: &[u8]) -> Result<Vec<StepRecord>, InvalidBody> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'{') {
        return Err(InvalidBody::new(
            "steps",
            "expected a JSON array of step records: send one record as [{...}], \
             or use Content-Type: application/x-ndjson with one record a line",
        ));
    }
    let records: Vec<StepRecord> = json_with_path(body, "steps")?;
    validate_batch(&records)?;
    Ok(records)
}

/// The media type of a CBOR body (RFC 8949): the steps batch and the registration,
/// the same data model as their JSON (v1.6).
pub const CBOR_CONTENT_TYPE: &str = "application/cbor";

/// Parses and validates a CBOR array of step records (`application/cbor`): the same
/// records, validation and error paths as [`parse_steps_json`].
pub fn parse_steps_cbor(body: &[u8]) -> Result<Vec<StepRecord>, InvalidBody> {
    let records: Vec<StepRecord> = bounded_cbor_with_path(body, "steps")?;
    validate_batch(&records)?;
    Ok(records)
}

/// Encodes a value as one CBOR data item, the body a client sends with
/// [`CBOR_CONTENT_TYPE`]. Non-finite [`crate::Float`]s go as their strings, as in JSON.
pub fn to_cbor<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut body = Vec::new();
    ciborium::into_writer(value, &mut body).expect("writing CBOR to a Vec cannot fail");
    body
}

/// Parses and validates NDJSON step records (`application/x-ndjson`): one JSON
/// object a line; blank lines are skipped. Paths count records (`steps[3]`), and
/// messages name the line.
pub fn parse_steps_ndjson(body: &[u8]) -> Result<Vec<StepRecord>, InvalidBody> {
    let mut records = Vec::new();
    for (line_index, line) in body.split(|b| *b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let root = format!("steps[{}]", records.len());
        let record: StepRecord = json_with_path(line, &root).map_err(|mut error| {
            error.message = format!("line {}: {}", line_index + 1, error.message);
            error
        })?;
        records.push(record);
        if records.len() > crate::limits::MAX_STEPS_PER_BATCH {
            break; // validate_batch reports the limit
        }
    }
    validate_batch(&records)?;
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Float;

    const EXAMPLE: &str = r#"{
      "step": 12,
      "time": "2026-11-21T10:00:12.345Z",
      "loss": 4.7711,
      "lr": 3e-4,
      "modules": [
        {"module": "qwen.layers.0.self_attn", "grad_norm": 1.2e-5, "hook_hits": 1}
      ],
      "params": [
        {"name": "qwen.layers.0.input_layernorm.weight", "grad_norm": 3.1e-3,
         "update_norm": 0.0, "drift": 0.0, "mean": 1.0}
      ],
      "scaler": {"scale": 65536.0, "growth_tracker": 3, "found_inf": false, "step_skipped": false},
      "gpu": [{"index": 0, "memory_used_bytes": 21474836480, "memory_total_bytes": 150754820096,
               "utilization_pct": 87, "temperature_c": 61, "power_w": 412.5}],
      "metrics": {"reward": 0.12, "mask_ratio": 0.95}
    }"#;

    #[test]
    fn the_protocol_example_parses() {
        let records = parse_steps_json(format!("[{EXAMPLE}]").as_bytes()).unwrap();
        assert_eq!(records[0].step, 12);
        assert_eq!(records[0].modules[0].hook_hits, Some(1));
        assert_eq!(records[0].gpu[0].memory_used_bytes, Some(21474836480));
        assert_eq!(records[0].metrics["reward"], Some(Float(0.12)));
    }

    #[test]
    fn ndjson_and_json_agree() {
        let compact: serde_json::Value = serde_json::from_str(EXAMPLE).unwrap();
        let line = serde_json::to_string(&compact).unwrap();
        let mut second = compact.clone();
        second["step"] = 13.into();
        let ndjson = format!("{line}\r\n\n{}\n", serde_json::to_string(&second).unwrap());
        let from_ndjson = parse_steps_ndjson(ndjson.as_bytes()).unwrap();
        let from_json = parse_steps_json(
            serde_json::to_string(&[compact, second])
                .unwrap()
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(from_ndjson, from_json);
    }

    #[test]
    fn absent_and_null_both_mean_not_measured() {
        let records = parse_steps_json(
            br#"[{"step": 0, "modules": null, "metrics": {"x": null}, "loss": null,
                  "params": [{"name": "w", "grad_norm": null}]}]"#,
        )
        .unwrap();
        assert!(records[0].modules.is_empty());
        assert_eq!(records[0].metrics["x"], None);
        assert_eq!(records[0].loss, None);
        assert_eq!(records[0].params[0].grad_norm, None);
    }

    #[test]
    fn errors_name_the_first_bad_field() {
        let ok = r#"{"step": 1, "modules": [{"module": "a", "grad_norm": 1.0}]}"#;
        let cases: &[(&str, &str, &str)] = &[
            (
                r#"[{"step": 0}, {"step": 1, "modules": [{"module": "a", "grad_norm": "oops"}]}]"#,
                "steps[1].modules[0].grad_norm",
                "unknown non-finite spelling",
            ),
            (r#"[{"step": -1}]"#, "steps[0].step", "must not be negative"),
            (r#"[{"step": 1.5}]"#, "steps[0].step", "must be an integer"),
            (
                r#"[{"step": "1"}]"#,
                "steps[0].step",
                "non-negative integer",
            ),
            (r#"[{"loss": 1}]"#, "steps[0]", "missing field `step`"),
            (
                r#"[{"step": 9007199254740992}]"#,
                "steps[0].step",
                "largest allowed",
            ),
            (
                r#"[{"step": 2}, {"step": 2}]"#,
                "steps[1].step",
                "strictly increase",
            ),
            (
                r#"[{"step": 3}, {"step": 1}]"#,
                "steps[1].step",
                "strictly increase",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "hook_hits": -1}]}]"#,
                "steps[0].modules[0].hook_hits",
                "-1",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "grad_norm": -0.5}]}]"#,
                "steps[0].modules[0].grad_norm",
                "cannot be negative",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": ""}]}]"#,
                "steps[0].modules[0].module",
                "empty",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a\u0007b"}]}]"#,
                "steps[0].modules[0].module",
                "control character",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a"}, {"module": "a"}]}]"#,
                "steps[0].modules[1].module",
                "twice",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "grad_nrom": 1}]}]"#,
                "steps[0].modules[0].grad_nrom",
                "unknown field `grad_nrom`",
            ),
            (r#"[{"step": 0}"#, "steps", "EOF"),
            (r#"[{"step": 0}] x"#, "steps", "trailing"),
            (r#"{"step": 0}"#, "steps", "JSON array"),
            (
                r#"[{"step": 0, "gpu": [{"index": 0, "utilization_pct": 101}]}]"#,
                "steps[0].gpu[0].utilization_pct",
                "between 0 and 100",
            ),
            (
                r#"[{"step": 0, "scaler": {"scale": -1}}]"#,
                "steps[0].scaler.scale",
                "negative",
            ),
            (
                r#"[{"step": 0, "rank": 1, "step_time": -0.1}]"#,
                "steps[0].step_time",
                "finite number of seconds",
            ),
            (r#"[{"step": 0, "rank": -1}]"#, "steps[0].rank", "-1"),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "grad_sumsq": -4}]}]"#,
                "steps[0].modules[0].grad_sumsq",
                "cannot be negative",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "numel": 4, "nonfinite": 5}]}]"#,
                "steps[0].modules[0].nonfinite",
                "cannot exceed numel",
            ),
        ];
        for (body, path, message) in cases {
            let err = parse_steps_json(body.as_bytes()).unwrap_err();
            assert_eq!(&err.path, path, "{body}: {err}");
            assert!(err.message.contains(message), "{body}: {err}");
        }
        assert!(parse_steps_json(format!("[{ok}]").as_bytes()).is_ok());
    }

    #[test]
    fn a_rank_sends_partial_sums() {
        let records = parse_steps_json(
            br#"[{"step": 4, "rank": 3, "step_time": 0.25,
                  "modules": [{"module": "a", "grad_sumsq": 2.25, "numel": 512, "nonfinite": 0},
                              {"module": "b", "grad_sumsq": "NaN", "numel": 8, "nonfinite": 1}],
                  "params": [{"name": "a.weight", "grad_norm": 1.5, "numel": 512}]}]"#,
        )
        .unwrap();
        let record = &records[0];
        assert_eq!(
            (record.rank, record.step_time),
            (Some(3), Some(Float(0.25)))
        );
        assert_eq!(record.modules[0].grad_sumsq, Some(Float(2.25)));
        assert_eq!(record.modules[0].numel, Some(512));
        assert!(record.modules[1].grad_sumsq.unwrap().get().is_nan());
        assert_eq!(record.modules[1].nonfinite, Some(1));
        assert_eq!(record.params[0].numel, Some(512));
    }

    /// A JSON text as the same data model in CBOR, the way a client encodes it.
    fn cbor_of(json: &str) -> Vec<u8> {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        to_cbor(&value)
    }

    #[test]
    fn cbor_and_json_agree() {
        let json = format!("[{EXAMPLE}]");
        let from_json = parse_steps_json(json.as_bytes()).unwrap();
        assert_eq!(parse_steps_cbor(&cbor_of(&json)).unwrap(), from_json);
        // What a Rust client sends: the typed records, non-finite floats as strings.
        let mut typed = from_json.clone();
        typed[0].loss = Some(Float(f64::NAN));
        typed[0].lr = Some(Float(f64::NEG_INFINITY));
        let back = parse_steps_cbor(&to_cbor(&typed)).unwrap();
        assert!(back[0].loss.unwrap().get().is_nan());
        assert_eq!(back[0].lr, Some(Float(f64::NEG_INFINITY)));
        assert_eq!(back[0].modules, typed[0].modules);
        // A native CBOR NaN is a NaN too.
        let mut native = Vec::new();
        ciborium::into_writer(
            &ciborium::Value::Array(vec![ciborium::Value::Map(vec![
                ("step".into(), 3.into()),
                ("loss".into(), ciborium::Value::Float(f64::NAN)),
            ])]),
            &mut native,
        )
        .unwrap();
        assert!(
            parse_steps_cbor(&native).unwrap()[0]
                .loss
                .unwrap()
                .get()
                .is_nan()
        );
    }

    #[test]
    fn cbor_errors_name_the_same_field_as_json() {
        let cases: &[(&str, &str, &str)] = &[
            (
                r#"[{"step": 0}, {"step": 1, "modules": [{"module": "a", "grad_norm": "oops"}]}]"#,
                "steps[1].modules[0].grad_norm",
                "unknown non-finite spelling",
            ),
            (r#"[{"step": -1}]"#, "steps[0].step", "must not be negative"),
            (r#"[{"loss": 1}]"#, "steps[0]", "missing field `step`"),
            (
                r#"[{"step": 2}, {"step": 2}]"#,
                "steps[1].step",
                "strictly increase",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "grad_nrom": 1}]}]"#,
                "steps[0].modules[0].grad_nrom",
                "unknown field `grad_nrom`",
            ),
            (
                r#"[{"step": 0, "modules": [{"module": "a", "grad_norm": -0.5}]}]"#,
                "steps[0].modules[0].grad_norm",
                "cannot be negative",
            ),
        ];
        for (json, path, message) in cases {
            let from_json = parse_steps_json(json.as_bytes()).unwrap_err();
            let err = parse_steps_cbor(&cbor_of(json)).unwrap_err();
            assert_eq!(&err.path, path, "{json}: {err}");
            assert_eq!(err.path, from_json.path, "{json}");
            assert!(err.message.contains(message), "{json}: {err}");
        }
        let body = cbor_of(r#"[{"step": 0}, {"step": 1}]"#);
        let err = parse_steps_cbor(&body[..body.len() - 2]).unwrap_err();
        assert!(err.message.contains("ends before"), "{err}");
        let mut trailing = body.clone();
        trailing.push(0);
        let err = parse_steps_cbor(&trailing).unwrap_err();
        assert_eq!(err.path, "steps");
        assert!(err.message.contains("trailing"), "{err}");
        let err = parse_steps_cbor(b"[{\"step\": 0}]").unwrap_err();
        assert_eq!(err.path, "steps", "JSON sent as CBOR: {err}");
        assert!(parse_steps_cbor(&[0xff]).is_err());
        assert!(parse_steps_cbor(&[]).is_err());
    }

    /// A CBOR text string's bytes.
    fn cbor_text(text: &str) -> Vec<u8> {
        let mut out = Vec::new();
        ciborium::into_writer(&text, &mut out).unwrap();
        out
    }

    /// One CBOR step batch `[{"step": 0, path[0]: {path[1]: … value}}]`, where a
    /// `[]` segment stands for an array of one element.
    fn step_body_with(path: &[&str], value: &[u8]) -> Vec<u8> {
        let mut inner = value.to_vec();
        for segment in path.iter().rev() {
            let mut outer = Vec::new();
            if *segment == "[]" {
                outer.push(0x81);
            } else {
                outer.push(0xa1);
                outer.extend(cbor_text(segment));
            }
            outer.extend(inner);
            inner = outer;
        }
        // [{"step": 0, …}]: the record's own map gets the step as a second entry.
        let mut body = vec![0x81, 0xa2];
        body.extend(cbor_text("step"));
        body.push(0x00);
        body.extend_from_slice(&inner[1..]);
        body
    }

    /// The same step batch as [`step_body_with`], in JSON.
    fn json_step_body_with(path: &[&str], value: &str) -> String {
        let mut inner = value.to_owned();
        for segment in path.iter().rev() {
            inner = if *segment == "[]" {
                format!("[{inner}]")
            } else {
                format!(r#"{{"{segment}": {inner}}}"#)
            };
        }
        format!(r#"[{{"step": 0, {}]"#, &inner[1..])
    }

    /// The fields serde names as expected after an unknown one, in `message`.
    fn expected_fields(message: &str) -> Vec<String> {
        let Some((_, list)) = message.split_once("expected") else {
            return Vec::new();
        };
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn a_hostile_nesting_is_refused_without_overflowing_the_stack() {
        // A million arrays deep, then 0: far past any stack if decoded recursively.
        let mut deep = vec![0x81u8; 1_000_000];
        deep.push(0x00);
        // The registration takes free-form `config`: only ciborium (and serde_json,
        // which stop at a fixed depth) may read it.
        let mut registration = vec![0xa1];
        registration.extend(cbor_text("config"));
        registration.extend(&deep);
        assert!(crate::RunRegistration::from_cbor(&registration).is_err());
        let deep_json = format!("{}0{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        let json = format!(r#"{{"config": {deep_json}}}"#);
        assert!(crate::RunRegistration::from_json(json.as_bytes()).is_err());
        // The step batch goes through the fast decoder, which has no depth limit: the
        // nesting is placed in every field of every struct a record holds, found by
        // asking the parser which fields it expects, down to three levels.
        let unknown = [0xa1]
            .into_iter()
            .chain(cbor_text("zz_unknown"))
            .chain([0x00])
            .collect::<Vec<u8>>();
        let mut paths: Vec<Vec<&str>> = vec![vec![]];
        let mut tried = 0;
        let mut names: Vec<String> = Vec::new();
        while let Some(path) = paths.pop() {
            let probe = if path.is_empty() {
                let mut body = vec![0x81, 0xa2];
                body.extend(cbor_text("step"));
                body.push(0x00);
                body.extend(&unknown[1..]);
                body
            } else {
                step_body_with(&path, &unknown)
            };
            let Err(error) = parse_steps_cbor(&probe) else {
                continue; // a map of free keys (metrics, lrs): its values are leaves
            };
            if error.message.contains("expected array") && path.len() < 4 {
                let mut deeper = path.clone();
                deeper.push("[]");
                paths.push(deeper);
                continue;
            }
            for field in expected_fields(&error.message) {
                let mut at = path.clone();
                names.push(field);
                at.push(Box::leak(names.last().unwrap().clone().into_boxed_str()));
                let body = step_body_with(&at, &deep);
                assert!(parse_steps_cbor(&body).is_err(), "{at:?}");
                let body = json_step_body_with(&at, &deep_json);
                assert!(parse_steps_json(body.as_bytes()).is_err(), "{at:?}");
                assert!(parse_steps_ndjson(&body.as_bytes()[1..body.len() - 1]).is_err());
                tried += 1;
                if at.iter().filter(|s| **s != "[]").count() < 3 {
                    paths.push(at);
                }
            }
        }
        // StepRecord's own fields and those of the modules, params, amendment, …
        assert!(tried > 40, "only {tried} fields reached: {names:?}");
        assert!(names.iter().any(|n| n == "grad_sumsq"), "{names:?}");
    }

    #[test]
    fn ndjson_errors_count_records_and_name_lines() {
        let body = "{\"step\": 0}\n\n{\"step\": \"x\"}\n";
        let err = parse_steps_ndjson(body.as_bytes()).unwrap_err();
        assert_eq!(err.path, "steps[1].step");
        assert!(err.message.starts_with("line 3:"), "{err}");
    }
}
