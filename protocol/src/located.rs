//! Deserialising JSON with errors that say where.
//!
//! Valid bodies take the fast path: plain `serde_json` straight into the typed values.
//! Only a body that fails is parsed a second time through `serde_path_to_error` to
//! find where, so tracking paths costs nothing on the ingest hot path.

use serde::de::DeserializeOwned;

use crate::error::InvalidBody;

/// Deserializes `body`; on failure the error's path is prefixed with `root`
/// (`steps`, or empty for an object body).
pub(crate) fn json_with_path<T: DeserializeOwned>(
    body: &[u8],
    root: &str,
) -> Result<T, InvalidBody> {
    match serde_json::from_slice(body) {
        Ok(value) => Ok(value),
        Err(fast) => Err(
            locate_error::<T>(body, root).unwrap_or_else(|| InvalidBody {
                path: root.to_owned(),
                message: fast.to_string(),
            }),
        ),
    }
}

fn locate_error<T: DeserializeOwned>(body: &[u8], root: &str) -> Option<InvalidBody> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let error = match serde_path_to_error::deserialize::<_, T>(&mut deserializer) {
        Ok(_) => match deserializer.end() {
            Ok(()) => return None,
            Err(trailing) => return Some(InvalidBody::new(root, trailing.to_string())),
        },
        Err(error) => error,
    };
    let path = join_path(root, &error.path().to_string());
    Some(InvalidBody::new(path, error.into_inner().to_string()))
}

/// `serde_path_to_error` writes the root as `.` and a top-level index as `[3]`.
fn join_path(root: &str, inner: &str) -> String {
    match inner {
        "." | "" => root.to_owned(),
        _ if root.is_empty() => inner.to_owned(),
        _ if inner.starts_with('[') => format!("{root}{inner}"),
        _ => format!("{root}.{inner}"),
    }
}
