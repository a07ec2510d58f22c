//! Deserialising JSON or CBOR with errors that say where.
//!
//! Valid bodies take the fast path straight into the typed values: JSON through
//! serde_json, and CBOR step batches through minicbor-serde (decoding from the body's
//! slice; other CBOR bodies through ciborium, see [`bounded_cbor_with_path`]). Only a
//! body that fails is parsed a second time through `serde_path_to_error` to find
//! where, so tracking paths costs nothing on the ingest hot path. That second pass is
//! serde_json's for JSON and ciborium's for CBOR, so the errors read as they always
//! have; should the two CBOR decoders ever disagree on a body the fast one refused,
//! ciborium's verdict stands.
//!
//! Every parser here must refuse a body nested far past its types (a hostile
//! `[[[[…` a million deep) with an error, never a stack overflow: serde_json stops at
//! 128 levels and ciborium at 256. sonic-rs, a SIMD JSON parser tried here, recursed
//! until the stack overflowed, even into typed structs, and is not used.

use serde::de::DeserializeOwned;

use crate::error::InvalidBody;

/// Deserializes `body` with serde_json, which refuses nesting past 128 levels; on
/// failure the error's path is prefixed with `root` (`steps`, or empty for an object
/// body).
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

/// [`cbor_with_path`] for a type whose nesting its own definition bounds, through the
/// fast decoder first.
///
/// minicbor-serde has no nesting limit, so a body nested a million deep where `T`
/// takes free-form data (a `serde_json::Value`, a `#[serde(flatten)]` map) would
/// overflow the stack. `T` must take none anywhere: every struct denying unknown
/// fields, no free-form values. The step batch is such a type (its test nests a
/// value a million deep in every field); the registration, with its free-form
/// `config`, is not, and goes through [`cbor_with_path`] alone, whose decoder stops
/// at 256 levels.
pub(crate) fn bounded_cbor_with_path<T: DeserializeOwned>(
    body: &[u8],
    root: &str,
) -> Result<T, InvalidBody> {
    let mut fast = minicbor_serde::Deserializer::new(body);
    if let Ok(value) = T::deserialize(&mut fast) {
        if fast.decoder().position() == body.len() {
            return Ok(value);
        }
    }
    cbor_with_path(body, root)
}

/// Deserializes one CBOR data item (RFC 8949) that makes up all of `body`; on failure
/// the error names the path as [`json_with_path`] does, and the byte offset where the
/// CBOR itself was malformed.
pub(crate) fn cbor_with_path<T: DeserializeOwned>(
    body: &[u8],
    root: &str,
) -> Result<T, InvalidBody> {
    let mut rest = body;
    let Ok(value) = ciborium::from_reader::<T, _>(&mut rest) else {
        return Err(locate_cbor_error::<T>(body, root));
    };
    if !rest.is_empty() {
        return Err(InvalidBody::new(
            root,
            format!(
                "trailing bytes after the CBOR data item at byte {}: send one item",
                body.len() - rest.len()
            ),
        ));
    }
    Ok(value)
}

fn locate_cbor_error<T: DeserializeOwned>(body: &[u8], root: &str) -> InvalidBody {
    match ciborium::from_reader::<Tracked<T>, _>(body) {
        Ok(_) => InvalidBody::new(root, "the CBOR body could not be read"),
        Err(error) => {
            let inner = FAILED_AT
                .with(|at| at.borrow_mut().take())
                .unwrap_or_default();
            InvalidBody::new(join_path(root, &inner), cbor_message(error))
        }
    }
}

thread_local! {
    /// Where the last [`Tracked`] deserialization on this thread failed.
    static FAILED_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// `T`, deserialized through `serde_path_to_error` inside whatever deserializer the
/// format has (ciborium's is not public, so it cannot be wrapped from outside): the
/// path of a failure is left in [`FAILED_AT`].
struct Tracked<T>(std::marker::PhantomData<T>);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Tracked<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut track = serde_path_to_error::Track::new();
        match T::deserialize(serde_path_to_error::Deserializer::new(
            deserializer,
            &mut track,
        )) {
            Ok(_) => Ok(Tracked(std::marker::PhantomData)),
            Err(error) => {
                let path = track.path().to_string();
                FAILED_AT.with(|at| *at.borrow_mut() = Some(path));
                Err(error)
            }
        }
    }
}

fn cbor_message(error: ciborium::de::Error<std::io::Error>) -> String {
    use ciborium::de::Error;
    match error {
        Error::Io(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            "the CBOR body ends before its data item does".to_owned()
        }
        Error::Io(error) => format!("the CBOR body could not be read: {error}"),
        Error::Syntax(offset) => format!("malformed CBOR at byte {offset}"),
        Error::Semantic(_, message) => message,
        Error::RecursionLimitExceeded => "the CBOR body nests too deeply".to_owned(),
    }
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
