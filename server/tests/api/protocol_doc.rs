//! docs/PROTOCOL.md is the reference clients are written against, so every example in
//! it is sent to a real server here, in the order the page gives them, and every
//! documented answer is compared with the real one.
//!
//! The page tags its examples after the fence's language: `json registration` (PUT as
//! a new run), `json steps` and `json step-record` (POSTed to the latest registered
//! run), `json response` (the previous request's answer, exactly), `json
//! invalid-steps` (POSTed, must be refused with 400 and change nothing), `json error`
//! (that refusal's body, exactly), `json webhook` (the body the webhook sender renders
//! for the alert it shows) and `json alert` (an alert the latest run now has:
//! same fields, same values except the ones written `"..."` and the ids).

use crate::common::TestApp;
use gradflow_core::detect::AlertKind;
use gradflow_server::error::ErrorCode;
use gradflow_server::store::webhooks::DueDelivery;
use gradflow_server::webhooks::render;
use serde_json::{Value, json};

const PAGE: &str = include_str!("../../../docs/PROTOCOL.md");

/// Every fenced example of the page: its tag and its text.
fn examples() -> Vec<(String, String)> {
    let mut examples = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in PAGE.lines() {
        if current.is_none() {
            if let Some(tag) = line.strip_prefix("```json") {
                current = Some((tag.trim().to_owned(), String::new()));
            }
        } else if line.starts_with("```") {
            examples.push(current.take().expect("an open fence"));
        } else if let Some((_, text)) = &mut current {
            text.push_str(line);
            text.push('\n');
        }
    }
    assert!(current.is_none(), "an example fence is never closed");
    examples
}

fn parse(tag: &str, text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("the {tag} example is not JSON: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_of_the_protocol_page_holds_against_a_real_server() {
    let app = TestApp::spawn().await;
    let mut run = String::new();
    let mut runs = 0;
    let mut last: Option<(u16, Value)> = None;
    let mut refusal: Option<Value> = None;
    let mut errors_documented = Vec::new();
    let mut checked = 0;
    for (tag, text) in examples() {
        let example = parse(&tag, &text);
        match tag.as_str() {
            "registration" => {
                runs += 1;
                run = format!("doc-{runs}");
                let response = app.register(&run, &example).await;
                let status = response.status().as_u16();
                let body: Value = response.json().await.expect("JSON answer");
                assert_eq!(status, 201, "registration example {runs}: {body}");
                last = Some((status, body));
            }
            "steps" | "step-record" => {
                let batch = if tag == "steps" {
                    example
                } else {
                    json!([example])
                };
                let response = app.post_steps(&run, &batch).await;
                let status = response.status().as_u16();
                let body: Value = response.json().await.expect("JSON answer");
                assert_eq!(status, 200, "{tag} example for {run}: {body}");
                last = Some((status, body));
            }
            "response" => {
                let (_, answer) = last.as_ref().expect("a response follows a request");
                assert_eq!(answer, &example, "the documented response differs");
            }
            "invalid-steps" => {
                let (_, before) = app.get_json(&format!("/api/v1/runs/{run}")).await;
                let response = app.post_steps(&run, &example).await;
                let status = response.status().as_u16();
                let body: Value = response.json().await.expect("JSON answer");
                assert_eq!(status, 400, "the invalid example was accepted: {body}");
                let (_, after) = app.get_json(&format!("/api/v1/runs/{run}")).await;
                assert_eq!(
                    before["step_count"], after["step_count"],
                    "a refused batch stored something"
                );
                refusal = Some(body);
            }
            "error" => errors_documented.push(example),
            "alert" => {
                let (status, body) = app
                    .get_json(&format!("/api/v1/runs/{run}/alerts?status=open"))
                    .await;
                assert_eq!(status, 200, "{body}");
                let alerts = body["alerts"].as_array().expect("alerts");
                let real = alerts
                    .iter()
                    .find(|a| a["kind"] == example["kind"])
                    .unwrap_or_else(|| panic!("{run} has no {} alert: {body}", example["kind"]));
                let documented = example.as_object().expect("an alert is an object");
                let actual = real.as_object().expect("an alert is an object");
                let mut documented_keys: Vec<&String> = documented.keys().collect();
                let mut actual_keys: Vec<&String> = actual.keys().collect();
                documented_keys.sort();
                actual_keys.sort();
                assert_eq!(documented_keys, actual_keys, "the alert's fields differ");
                for (key, value) in documented {
                    if key == "id" || key == "run_id" || value == "..." {
                        continue;
                    }
                    assert_eq!(&actual[key], value, "the alert's {key} differs");
                }
            }
            "webhook" => {
                // The generic body the sender renders for the alert shown.
                let delivery = DueDelivery {
                    id: 1,
                    url: "http://127.0.0.1:1/".into(),
                    format: "generic".into(),
                    action: "opened".into(),
                    payload: example["alert"].to_string(),
                    attempts: 0,
                };
                let rendered = render(&delivery, Some("https://gradflow.example")).unwrap();
                assert_eq!(rendered, example, "the documented webhook body differs");
            }
            other => panic!("unknown example tag {other:?} in docs/PROTOCOL.md"),
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} examples found on the page");
    let refusal = refusal.expect("the page shows a refused batch");
    assert!(!errors_documented.is_empty());
    for documented in errors_documented {
        assert_eq!(documented, refusal, "the documented error body differs");
    }
}

#[test]
fn the_page_lists_every_error_code_with_its_status() {
    // The paragraph after the error body's example: "`code` is one of ...".
    let start = PAGE.find("`code` is one of").expect("the error code list");
    let list = &PAGE[start..start + PAGE[start..].find("`path` names").expect("its end")];
    for code in ErrorCode::ALL {
        let name = format!("`{}`", code.as_str());
        let at = list
            .find(&name)
            .unwrap_or_else(|| panic!("docs/PROTOCOL.md does not list {name}"));
        // The status stated after the code (or after the codes that share it).
        let status = code.status().as_u16().to_string();
        let after = &list[at..];
        let stated = after.find('(').map(|open| &after[open + 1..open + 4]);
        assert_eq!(stated, Some(status.as_str()), "{name} in {list}");
    }
}

/// The alert table's rows: each kind and the severities its last column names.
fn alert_table() -> Vec<(String, Vec<String>)> {
    let start = PAGE.find("| kind | opens when |").expect("the alert table");
    PAGE[start..]
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
            let kind = cells[0].trim_matches('`').to_owned();
            let severities = cells[cells.len() - 1]
                .split([',', ' '])
                .filter(|word| !word.is_empty() && *word != "or")
                .map(str::to_owned)
                .collect();
            (kind, severities)
        })
        .collect()
}

#[test]
fn the_alert_table_is_the_kinds_table_row_for_row() {
    let documented = alert_table();
    let kinds: Vec<(String, Vec<String>)> = AlertKind::ALL
        .iter()
        .map(|kind| {
            let severities = kind.properties().severities.iter();
            let severities = severities.map(|s| s.as_str().to_owned()).collect();
            (kind.as_str().to_owned(), severities)
        })
        .collect();
    for (row, kind) in documented.iter().zip(&kinds) {
        assert_eq!(
            row, kind,
            "docs/PROTOCOL.md's alert table against AlertKind's"
        );
    }
    assert_eq!(
        documented.len(),
        kinds.len(),
        "docs/PROTOCOL.md: {documented:?}"
    );
}
