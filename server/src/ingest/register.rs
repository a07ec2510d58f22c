//! Registering a run: the first registration stores it (with the alerts the
//! registration alone proves); the same registration again is welcome; a different
//! one is a conflict that names the first field that differs.

use anyhow::Context;
use gradflow_protocol::RunRegistration;
use serde_json::Value;

use super::error::{IngestError, IngestResult};
use crate::store::StoreResult;

/// The registration as compared between two `PUT`s of one run: everything but who
/// sent it. In a multi-rank run every rank registers, each naming itself in `rank`
/// and `host`.
pub fn comparable(registration: &RunRegistration) -> StoreResult<Value> {
    let mut value = serde_json::to_value(registration).context("encoding a registration")?;
    if let Some(object) = value.as_object_mut() {
        object.remove("rank");
        object.remove("host");
    }
    Ok(value)
}

/// `Ok` when `new` registers the same run as `stored` (as first sent), otherwise the
/// conflict to answer.
pub fn compare(run_id: &str, stored: &RunRegistration, new: &RunRegistration) -> IngestResult<()> {
    let old = comparable(stored)?;
    let new = comparable(new)?;
    let Some(path) = first_difference(&old, &new, String::new()) else {
        return Ok(());
    };
    Err(IngestError::Conflict {
        message: format!(
            "run {run_id} is already registered with a different body{}; to change the \
             registration while the run trains, send the change as an amendment (`amend` in \
             a step record, in force from that record's step); otherwise register under a \
             new run id, or DELETE the run first",
            if path.is_empty() {
                String::new()
            } else {
                format!(" (first difference at {path})")
            }
        ),
        path,
    })
}

/// The path of the first place where two JSON values differ, in the protocol's path
/// notation (`params[3].dtype`), or `None` when they are equal.
fn first_difference(a: &Value, b: &Value, path: String) -> Option<String> {
    let join = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .find_map(|key| match (x.get(key), y.get(key)) {
                    (Some(u), Some(v)) => first_difference(u, v, join(key)),
                    _ => Some(join(key)),
                })
        }
        (Value::Array(x), Value::Array(y)) => {
            let common = x
                .iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (u, v))| first_difference(u, v, format!("{path}[{i}]")));
            common.or_else(|| {
                (x.len() != y.len()).then(|| format!("{path}[{}]", x.len().min(y.len())))
            })
        }
        _ => (a != b).then_some(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ranks_of_one_run_register_alike() {
        let rank = |rank: u32, host: &str| -> RunRegistration {
            serde_json::from_value(json!({"world_size": 2, "rank": rank, "host": host,
                "params": [{"name": "a.weight", "layout": "sharded"}]}))
            .unwrap()
        };
        assert!(compare("r", &rank(0, "node-0"), &rank(1, "node-1")).is_ok());
        let other: RunRegistration =
            serde_json::from_value(json!({"world_size": 4, "rank": 1, "params": []})).unwrap();
        match compare("r", &rank(0, "node-0"), &other) {
            Err(IngestError::Conflict { path, .. }) => assert_eq!(path, "params[0]"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn first_difference_names_the_field() {
        let a = json!({"params": [{"name": "a", "dtype": "f32"}], "name": "x"});
        let b = json!({"params": [{"name": "a", "dtype": "bf16"}], "name": "x"});
        assert_eq!(first_difference(&a, &a, String::new()), None);
        assert_eq!(
            first_difference(&a, &b, String::new()).as_deref(),
            Some("params[0].dtype")
        );
        let c = json!({"params": [{"name": "a", "dtype": "f32"}, {"name": "b"}], "name": "x"});
        assert_eq!(
            first_difference(&a, &c, String::new()).as_deref(),
            Some("params[1]")
        );
        let d = json!({"params": [{"name": "a", "dtype": "f32"}]});
        assert_eq!(
            first_difference(&a, &d, String::new()).as_deref(),
            Some("name")
        );
    }
}
