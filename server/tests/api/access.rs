//! Who may read and from where: `--read-token` (bearer or the login cookie) and
//! `--cors-origin`, against a real server.

use crate::common::{TestApp, error_of, registration, steps};
use clap::Parser;
use gradflow_server::config::ServerConfig;
use reqwest::header::{self, HeaderMap};
use reqwest::redirect::Policy;
use reqwest::{Client, Method};

/// A client that shows redirects instead of following them.
fn no_redirects() -> Client {
    Client::builder().redirect(Policy::none()).build().unwrap()
}

async fn status_of(request: reqwest::RequestBuilder) -> u16 {
    request.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_read_token_guards_every_read_and_the_dashboard() {
    let app = TestApp::spawn_with(|c| {
        c.read_token = Some("r34d".into());
        c.ingest_token = Some("wr1te".into());
    })
    .await;
    let client = no_redirects();
    let ok = client
        .put(app.url("/api/v1/runs/r1"))
        .bearer_auth("wr1te")
        .json(&registration())
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 201);

    // API reads and /metrics: 401 with a message that says what to send.
    for path in [
        "/api/v1/runs",
        "/api/v1/runs/r1",
        "/api/v1/runs/r1/series?metric=loss",
        "/api/v1/alerts",
        "/api/v1/runs/r1/charts/loss.svg",
        "/api/v1/events",
        "/api/v1/openapi.json",
        "/metrics",
    ] {
        let (status, error) = error_of(client.get(app.url(path)).send().await.unwrap()).await;
        assert_eq!(status, 401, "{path}");
        assert_eq!(error["code"], "unauthorized", "{path}");
        assert!(
            error["message"].as_str().unwrap().contains("read token"),
            "{path}: {error}"
        );
        let wrong = client.get(app.url(path)).bearer_auth("guess").send().await;
        assert_eq!(wrong.unwrap().status(), 401, "{path} with a wrong token");
    }
    // The read token and the ingest token both read.
    for token in ["r34d", "wr1te"] {
        let r = client.get(app.url("/api/v1/runs/r1")).bearer_auth(token);
        assert_eq!(status_of(r).await, 200, "reading with {token}");
        let r = client.get(app.url("/metrics")).bearer_auth(token);
        assert_eq!(status_of(r).await, 200);
    }
    // The read token does not write.
    let write = client
        .post(app.url("/api/v1/runs/r1/steps"))
        .bearer_auth("r34d")
        .json(&steps(0..1))
        .send()
        .await
        .unwrap();
    assert_eq!(write.status(), 401);

    // Pages send a browser to the login page, remembering where it was going.
    for (path, next) in [
        ("/", "%2F"),
        ("/runs/r1?from_step=3", "%2Fruns%2Fr1%3Ffrom_step%3D3"),
    ] {
        let response = client.get(app.url(path)).send().await.unwrap();
        assert_eq!(response.status(), 303, "{path}");
        assert_eq!(
            response.headers()[header::LOCATION],
            format!("/login?next={next}").as_str(),
            "{path}"
        );
    }
    // What must stay reachable without a token.
    for path in ["/healthz", "/login", "/static/gradflow.css"] {
        let r = client.get(app.url(path));
        assert_eq!(status_of(r).await, 200, "{path}");
    }
}

fn set_cookie(headers: &HeaderMap) -> String {
    headers[header::SET_COOKIE].to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logging_in_sets_a_cookie_the_pages_and_streams_accept() {
    // A token with characters a cookie cannot hold as they are.
    let token = "t0k en;=\"ü";
    let app = TestApp::spawn_with(|c| c.read_token = Some(token.into())).await;
    app.register("r1", &registration()).await;
    let client = no_redirects();

    let wrong = client
        .post(app.url("/login"))
        .form(&[("token", "guess"), ("next", "/runs/r1")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get(header::SET_COOKIE).is_none());
    let page = wrong.text().await.unwrap();
    assert!(page.contains("That is not this server"), "{page}");

    // An open redirect is refused: `next` may only be a path on this server.
    let elsewhere = client
        .post(app.url("/login"))
        .form(&[("token", token), ("next", "//evil.example/")])
        .send()
        .await
        .unwrap();
    assert_eq!(elsewhere.status(), 303);
    assert_eq!(elsewhere.headers()[header::LOCATION], "/");

    let login = client
        .post(app.url("/login"))
        .form(&[("token", token), ("next", "/runs/r1")])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303);
    assert_eq!(login.headers()[header::LOCATION], "/runs/r1");
    let cookie = set_cookie(login.headers());
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(attribute), "{attribute} in {cookie}");
    }
    let pair = cookie.split(';').next().unwrap().to_owned();

    for path in [
        "/",
        "/runs/r1",
        "/api/v1/runs/r1",
        "/api/v1/runs/r1/charts/loss.svg",
    ] {
        let r = client.get(app.url(path)).header(header::COOKIE, &pair);
        assert_eq!(status_of(r).await, 200, "{path} with the cookie");
    }
    // The dashboard's live updates: EventSource sends the cookie, nothing else.
    let events = client
        .get(app.url("/api/v1/events"))
        .header(header::COOKIE, &pair)
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    assert_eq!(events.headers()[header::CONTENT_TYPE], "text/event-stream");
    drop(events);
    // A cookie with another value is no login.
    let forged = client
        .get(app.url("/"))
        .header(header::COOKIE, "gradflow_token=r34d");
    assert_eq!(status_of(forged).await, 303);

    let logout = client
        .post(app.url("/logout"))
        .header(header::COOKIE, &pair)
        .send()
        .await
        .unwrap();
    assert_eq!(logout.status(), 303);
    let cleared = set_cookie(logout.headers());
    assert!(cleared.starts_with("gradflow_token=;"), "{cleared}");
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_read_token_reads_are_open_and_login_says_so() {
    let app = TestApp::spawn().await;
    let client = no_redirects();
    for path in ["/", "/api/v1/runs", "/metrics"] {
        let r = client.get(app.url(path));
        assert_eq!(status_of(r).await, 200, "{path}");
    }
    let page = client.get(app.url("/login")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("No login needed"));
}

async fn preflight(app: &TestApp, origin: &str) -> HeaderMap {
    let response = app
        .client
        .request(Method::OPTIONS, app.url("/api/v1/runs/r1/steps"))
        .header(header::ORIGIN, origin)
        .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
        .header(
            header::ACCESS_CONTROL_REQUEST_HEADERS,
            "authorization,content-type",
        )
        .send()
        .await
        .unwrap();
    response.headers().clone()
}

/// The headers of a plain cross-origin read from `origin`.
async fn read_from(app: &TestApp, origin: &str) -> HeaderMap {
    let response = app
        .client
        .get(app.url("/api/v1/runs"))
        .header(header::ORIGIN, origin)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.headers().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cors_unless_configured() {
    let app = TestApp::spawn().await;
    let headers = preflight(&app, "https://nb.example").await;
    assert!(headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
    let read = read_from(&app, "https://nb.example").await;
    assert!(read.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_allows_only_the_configured_origins() {
    let app = TestApp::spawn_with(|c| {
        c.cors_origins = vec!["https://nb.example".into()];
        c.ingest_token = Some("wr1te".into());
    })
    .await;
    let allowed = preflight(&app, "https://nb.example").await;
    assert_eq!(
        allowed[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://nb.example"
    );
    let allowed_headers = allowed[header::ACCESS_CONTROL_ALLOW_HEADERS]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(
        allowed_headers.contains("authorization"),
        "{allowed_headers}"
    );
    assert!(
        allowed
            .get(header::ACCESS_CONTROL_ALLOW_CREDENTIALS)
            .is_none(),
        "no cookies cross-origin"
    );

    let other = preflight(&app, "https://evil.example").await;
    assert!(other.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).is_none());

    let read = read_from(&app, "https://nb.example").await;
    assert_eq!(
        read[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://nb.example"
    );
}

#[test]
fn a_malformed_cors_origin_stops_the_server_at_startup() {
    let error = ServerConfig::try_parse_from(["gradflow-server", "--cors-origin", "nb.example"])
        .unwrap_err()
        .to_string();
    assert!(error.contains("scheme://host[:port]"), "{error}");
    let config = ServerConfig::try_parse_from([
        "gradflow-server",
        "--cors-origin",
        "https://a.example,http://localhost:8888",
    ])
    .unwrap();
    assert_eq!(
        config.cors_origins,
        ["https://a.example", "http://localhost:8888"]
    );
}
