//! Reading request bodies as docs/PROTOCOL.md's Transport section says: JSON, NDJSON or
//! CBOR, optionally gzip-compressed, within a size limit that applies to the bytes received
//! and again to the bytes decompressed (so a gzip bomb is a `413`, not an outage).
//!
//! Written here rather than with tower-http's decompression and body-limit layers
//! because those answer in plain text, and every error of this API must be the JSON
//! error body with its own code (`413 body_too_large`, `415 unsupported_encoding`,
//! `400 invalid_gzip`).

use std::io::Read;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use flate2::read::MultiGzDecoder;
use http_body_util::BodyExt;

use crate::error::{ApiError, ErrorCode};

/// How a body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// `application/json`.
    Json,
    /// `application/x-ndjson`: one JSON value a line.
    Ndjson,
    /// `application/cbor` (RFC 8949): one CBOR data item, the JSON body's data model.
    Cbor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEncoding {
    Identity,
    Gzip,
}

/// Reads the `Content-Type`; `allow_ndjson` is true where the protocol takes NDJSON.
pub fn body_format(headers: &HeaderMap, allow_ndjson: bool) -> Result<BodyFormat, ApiError> {
    let accepted = if allow_ndjson {
        "application/json, application/x-ndjson or application/cbor"
    } else {
        "application/json or application/cbor"
    };
    let unsupported = |what: String| {
        ApiError::new(
            ErrorCode::UnsupportedMediaType,
            format!("{what}: send Content-Type: {accepted}"),
        )
    };
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Err(unsupported("the request has no Content-Type".into()));
    };
    let value = value
        .to_str()
        .map_err(|_| unsupported("the Content-Type is not readable text".into()))?;
    let mut parts = value.split(';');
    let mime = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    for parameter in parts {
        let (name, val) = parameter.split_once('=').unwrap_or((parameter, ""));
        if name.trim().eq_ignore_ascii_case("charset")
            && !val.trim().trim_matches('"').eq_ignore_ascii_case("utf-8")
        {
            return Err(unsupported(format!(
                "charset {:?} is not supported, bodies are UTF-8",
                val.trim()
            )));
        }
    }
    match mime.as_str() {
        "application/json" => Ok(BodyFormat::Json),
        "application/x-ndjson" if allow_ndjson => Ok(BodyFormat::Ndjson),
        "application/cbor" => Ok(BodyFormat::Cbor),
        _ => Err(unsupported(format!(
            "Content-Type {value:?} is not accepted here"
        ))),
    }
}

/// Reads the `Content-Encoding`: none, `identity` or `gzip`.
pub fn body_encoding(headers: &HeaderMap) -> Result<BodyEncoding, ApiError> {
    let Some(value) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(BodyEncoding::Identity);
    };
    match value
        .to_str()
        .map(|v| v.trim().to_ascii_lowercase())
        .as_deref()
    {
        Ok("identity") | Ok("") => Ok(BodyEncoding::Identity),
        Ok("gzip") | Ok("x-gzip") => Ok(BodyEncoding::Gzip),
        _ => Err(ApiError::new(
            ErrorCode::UnsupportedEncoding,
            format!(
                "Content-Encoding {:?} is not supported: send the body uncompressed or as gzip",
                String::from_utf8_lossy(value.as_bytes())
            ),
        )),
    }
}

fn too_large(limit: usize, what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::BodyTooLarge,
        format!(
            "the {what} is larger than the server's limit of {limit} bytes: send smaller batches"
        ),
    )
}

/// Receives the body, at most `limit` bytes of it.
///
/// An over-limit body is read to its end and thrown away (up to `DRAIN_FACTOR` times
/// the limit) before the `413` goes out: a client that sends without
/// `Expect: 100-continue`, as most do, is still writing when the server answers, and a
/// connection closed under it fails its write with EPIPE before it reads the answer
/// that says what was wrong. The request timeout bounds how long a slow sender holds it.
pub async fn receive(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut body = body;
    if declared.is_some_and(|n| n > limit as u64) {
        discard(&mut body, limit, 0).await;
        return Err(too_large(limit, "request body"));
    }
    let mut received = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            ApiError::new(
                ErrorCode::InvalidBody,
                format!("could not read the request body: {error}"),
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if received.len() + data.len() > limit {
            discard(&mut body, limit, received.len() + data.len()).await;
            return Err(too_large(limit, "request body"));
        }
        received.extend_from_slice(&data);
    }
    Ok(Bytes::from(received))
}

/// How many times the body limit [`receive`] reads and discards of a body over it
/// before it gives up and lets the connection close.
const DRAIN_FACTOR: usize = 4;

/// Reads `body` to its end, or until `already + what it reads` passes
/// `DRAIN_FACTOR × limit`, keeping nothing.
async fn discard(body: &mut Body, limit: usize, already: usize) {
    let mut seen = already;
    while seen <= limit.saturating_mul(DRAIN_FACTOR) {
        match body.frame().await {
            Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |d| d.len()),
            Some(Err(_)) | None => return,
        }
    }
}

/// Decompresses a received body if it is gzip, to at most `limit` bytes. CPU-bound:
/// call it off the async executor for large bodies.
pub fn decode(bytes: Bytes, encoding: BodyEncoding, limit: usize) -> Result<Bytes, ApiError> {
    match encoding {
        BodyEncoding::Identity => Ok(bytes),
        BodyEncoding::Gzip => {
            let mut decoded = Vec::with_capacity((bytes.len() * 4).min(limit));
            let mut reader = MultiGzDecoder::new(&bytes[..]).take(limit as u64 + 1);
            reader.read_to_end(&mut decoded).map_err(|error| {
                ApiError::new(
                    ErrorCode::InvalidGzip,
                    format!("the gzip body could not be decompressed: {error}"),
                )
            })?;
            if decoded.len() > limit {
                return Err(too_large(limit, "decompressed request body"));
            }
            Ok(Bytes::from(decoded))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use flate2::Compression;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(name.clone(), HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn content_types() {
        let ct = |v: &str| headers(&[(header::CONTENT_TYPE, v)]);
        assert_eq!(
            body_format(&ct("application/json"), false).unwrap(),
            BodyFormat::Json
        );
        assert_eq!(
            body_format(&ct("Application/JSON; charset=UTF-8"), false).unwrap(),
            BodyFormat::Json
        );
        assert_eq!(
            body_format(&ct("application/x-ndjson"), true).unwrap(),
            BodyFormat::Ndjson
        );
        for ndjson in [false, true] {
            assert_eq!(
                body_format(&ct("application/CBOR"), ndjson).unwrap(),
                BodyFormat::Cbor
            );
        }
        for (value, ndjson) in [
            ("application/x-ndjson", false),
            ("text/plain", true),
            ("application/msgpack", true),
            ("application/x-www-form-urlencoded", true),
            ("application/json; charset=latin1", true),
        ] {
            let err = body_format(&ct(value), ndjson).unwrap_err();
            assert_eq!(
                err.status(),
                axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "{value}"
            );
        }
        assert!(body_format(&HeaderMap::new(), true).is_err());
    }

    #[test]
    fn encodings() {
        let ce = |v: &str| headers(&[(header::CONTENT_ENCODING, v)]);
        assert_eq!(
            body_encoding(&HeaderMap::new()).unwrap(),
            BodyEncoding::Identity
        );
        assert_eq!(body_encoding(&ce("gzip")).unwrap(), BodyEncoding::Gzip);
        assert_eq!(
            body_encoding(&ce("br")).unwrap_err().code(),
            ErrorCode::UnsupportedEncoding
        );
    }

    #[test]
    fn gzip_is_decoded_within_the_limit() {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
        encoder.write_all(&vec![b'a'; 10_000]).unwrap();
        let gz = Bytes::from(encoder.finish().unwrap());
        assert_eq!(
            decode(gz.clone(), BodyEncoding::Gzip, 10_000)
                .unwrap()
                .len(),
            10_000
        );
        let err = decode(gz, BodyEncoding::Gzip, 9_999).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::PAYLOAD_TOO_LARGE);
        let err = decode(Bytes::from_static(b"not gzip"), BodyEncoding::Gzip, 100).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidGzip);
    }
}
