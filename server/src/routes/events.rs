//! `GET /api/v1/events?run_id=`: Server-Sent Events. `step` when a batch is stored,
//! `alert` when an alert opens or resolves (its `data` is the JSON event with the
//! whole alert), `lagged` when this listener fell behind and missed some.

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::{Stream, StreamExt};
use gradflow_protocol::RunId;
use serde::Deserialize;
use tokio::sync::broadcast::error::RecvError;

use super::extract::ApiQuery;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsParams {
    run_id: Option<String>,
}

#[utoipa::path(get, path = "/api/v1/events", tag = "events",
    params(("run_id" = Option<String>, Query, description = "Only this run's events")),
    responses(
        (status = 200, description = "Server-Sent Events: `step` ({type, run_id, last_step, accepted}), `alert` ({type, action: opened|resolved, alert}), `lagged` (events missed)", content_type = "text/event-stream"),
        (status = 400, response = crate::api_types::BadRequest)))]
pub async fn stream_events(
    State(state): State<AppState>,
    ApiQuery(params): ApiQuery<EventsParams>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let run_id = match params.run_id.as_deref() {
        Some(raw) => {
            Some(RunId::parse(raw).map_err(|m| ApiError::invalid_query(m).with_path("run_id"))?)
        }
        None => None,
    };
    let receiver = state.events.subscribe();
    let events = futures_util::stream::unfold(receiver, move |mut receiver| {
        let run_id = run_id.clone();
        async move {
            loop {
                match receiver.recv().await {
                    Ok(event) => {
                        if run_id
                            .as_ref()
                            .is_some_and(|id| id.as_str() != event.run_id())
                        {
                            continue;
                        }
                        let sse = SseEvent::default()
                            .event(event.name())
                            .json_data(&event)
                            .unwrap_or_else(|_| SseEvent::default().event("error"));
                        return Some((Ok(sse), receiver));
                    }
                    Err(RecvError::Lagged(missed)) => {
                        let sse = SseEvent::default().event("lagged").data(missed.to_string());
                        return Some((Ok(sse), receiver));
                    }
                    Err(RecvError::Closed) => return None,
                }
            }
        }
    });
    // An event stream never ends by itself: end it on shutdown, so graceful shutdown
    // is not held up by listeners.
    let mut shutdown = state.shutdown.clone();
    let stopped = async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    Ok(Sse::new(events.take_until(stopped)).keep_alive(KeepAlive::default()))
}
