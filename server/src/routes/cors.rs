//! Cross-origin access. Without `--cors-origin` there is no CORS layer at all, so
//! pages of other origins cannot read any response (the browser's same-origin rule).
//! With it, the listed origins (or `*`, any) may call the API from a browser, with
//! the headers the API needs (`Authorization` for the tokens, `Content-Encoding`
//! for gzip bodies). Credentials (cookies) are never allowed cross-origin: the
//! login cookie is for the dashboard itself.

use axum::http::{HeaderValue, Method, header};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// The CORS layer for `origins` (already checked by [`parse_origin`]); `None` when
/// none are configured.
pub fn layer(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .map(|o| HeaderValue::from_str(o).expect("origins are checked at startup")),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([
                Method::GET,
                Method::HEAD,
                Method::POST,
                Method::PUT,
                Method::DELETE,
            ])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                header::CONTENT_ENCODING,
            ])
            .expose_headers([header::RETRY_AFTER])
            .max_age(std::time::Duration::from_secs(600)),
    )
}

/// Checks one `--cors-origin` value: `*`, or `scheme://host[:port]` as a browser sends
/// it in `Origin` (no path, no trailing slash).
pub fn parse_origin(text: &str) -> Result<String, String> {
    if text == "*" {
        return Ok(text.to_owned());
    }
    let Some((scheme, rest)) = text.split_once("://") else {
        return Err(format!(
            "{text:?} is not an origin: write scheme://host[:port], e.g. https://notebook.example.com"
        ));
    };
    if !matches!(scheme, "http" | "https") {
        return Err(format!("{text:?}: the scheme must be http or https"));
    }
    if rest.is_empty() || rest.contains(['/', '?', '#', ' ']) {
        return Err(format!(
            "{text:?}: an origin has no path, query or trailing slash (scheme://host[:port])"
        ));
    }
    HeaderValue::from_str(text).map_err(|_| format!("{text:?} is not a valid header value"))?;
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::parse_origin;

    #[test]
    fn origins_are_checked() {
        for good in ["*", "https://a.example", "http://localhost:8888"] {
            assert_eq!(parse_origin(good).as_deref(), Ok(good));
        }
        for bad in [
            "a.example",
            "ftp://a.example",
            "https://a.example/",
            "https://",
            "https://a.example/path",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad:?}");
        }
    }
}
