//! `GET /login`, `POST /login` and `POST /logout`: how a browser gets past
//! `--read-token`. A correct token is kept in an HttpOnly, SameSite=Strict cookie,
//! which the pages, their chart images and the event stream then carry.

use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use cookie::{Cookie, SameSite};
use maud::{Markup, html};
use serde::Deserialize;

use super::{layout, page_response};
use crate::routes::auth::LOGIN_COOKIE;
use crate::state::AppState;

/// How long a login lasts.
const LOGIN_DAYS: i64 = 30;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/login", get(show_login).post(log_in))
        .route("/logout", post(log_out))
}

#[derive(Debug, Deserialize)]
pub struct LoginQuery {
    next: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct LoginForm {
    token: String,
    next: Option<String>,
}

async fn show_login(State(state): State<AppState>, Query(query): Query<LoginQuery>) -> Response {
    let next = safe_next(query.next.as_deref());
    if state.settings.read_token.is_none() {
        return page_response(
            StatusCode::OK,
            layout::page(
                "Log in",
                None,
                html! {
                    h1 { "No login needed" }
                    p { "This server has no read token: its pages are open to whoever can reach it." }
                    p { a href=(next) { "Continue" } }
                },
            ),
        );
    }
    page_response(StatusCode::OK, login_page(next, None))
}

async fn log_in(State(state): State<AppState>, Form(form): Form<LoginForm>) -> Response {
    let next = safe_next(form.next.as_deref());
    if state.settings.read_token.is_some() && !state.settings.may_read(&form.token) {
        return page_response(
            StatusCode::UNAUTHORIZED,
            login_page(next, Some("That is not this server's read token.")),
        );
    }
    let cookie = Cookie::build((LOGIN_COOKIE, form.token))
        .http_only(true)
        .same_site(SameSite::Strict)
        .path("/")
        .max_age(time::Duration::days(LOGIN_DAYS))
        .build();
    with_cookie(Redirect::to(next), &cookie)
}

async fn log_out() -> Response {
    let cookie = Cookie::build((LOGIN_COOKIE, ""))
        .http_only(true)
        .same_site(SameSite::Strict)
        .path("/")
        .max_age(time::Duration::ZERO)
        .build();
    with_cookie(Redirect::to("/login"), &cookie)
}

fn with_cookie(redirect: Redirect, cookie: &Cookie<'_>) -> Response {
    let mut response = redirect.into_response();
    let value = HeaderValue::from_str(&cookie.encoded().to_string())
        .expect("a percent-encoded cookie is a valid header value");
    response.headers_mut().insert(header::SET_COOKIE, value);
    response
}

fn login_page(next: &str, error: Option<&str>) -> Markup {
    layout::page(
        "Log in",
        None,
        html! {
            h1 { "Log in" }
            p { "This server asks for its read token (the one set with " code { "--read-token" } ")." }
            @if let Some(error) = error {
                p.error-message role="alert" { (error) }
            }
            form.login method="post" action="/login" {
                input type="hidden" name="next" value=(next);
                label for="token" { "Read token" }
                input #token type="password" name="token" autocomplete="current-password" required autofocus;
                button type="submit" { "Log in" }
            }
        },
    )
}

/// Where to go after logging in: a path on this server, never another origin
/// (`//evil.example` and `/\evil.example` are both read as other hosts by browsers).
fn safe_next(next: Option<&str>) -> &str {
    match next {
        Some(path)
            if path.starts_with('/')
                && !path.starts_with("//")
                && !path.contains('\\')
                && !path.chars().any(char::is_control) =>
        {
            path
        }
        _ => "/",
    }
}

#[cfg(test)]
mod tests {
    use super::safe_next;

    #[test]
    fn next_stays_on_this_server() {
        assert_eq!(
            safe_next(Some("/runs/a?from_step=3")),
            "/runs/a?from_step=3"
        );
        for other in [
            "//evil.example",
            "/\\evil.example",
            "https://evil.example",
            "evil",
            "/a\nb",
        ] {
            assert_eq!(safe_next(Some(other)), "/", "{other:?}");
        }
        assert_eq!(safe_next(None), "/");
    }
}
