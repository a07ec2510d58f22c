//! The frame every page shares, and the formatting the pages agree on.

use maud::{DOCTYPE, Markup, html};

use super::assets;
use gradflow_core::model::cell::{Cell, widen_for_display};

/// A whole page: `title` in the tab, `page` names the script's behaviour
/// (`data-page` on `<body>`), `body` inside `<main>`.
pub fn page(title: &str, page: Option<(&str, Option<&str>)>, body: Markup) -> Markup {
    let (page_name, run_id) = page.unwrap_or(("error", None));
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · gradflow" }
                // No favicon request (and no 404 for it in the console).
                link rel="icon" href="data:,";
                link rel="stylesheet" href=(assets::url("gradflow.css"));
                script src=(assets::url("dashboard.js")) defer {}
            }
            body data-page=(page_name) data-run-id=[run_id] {
                a.skip-link href="#main" { "Skip to content" }
                header.site {
                    a.brand href="/" { "gradflow" }
                    span.tagline { "gradient-flow diagnostics" }
                    span #live-indicator .live-indicator role="status" aria-live="polite" {}
                }
                main #main tabindex="-1" { (body) }
            }
        }
    }
}

/// A stored value for a person: `1.23e-4`, `NaN`, or `None` when absent or null.
pub fn number(cell: Option<Cell>) -> Option<String> {
    match cell {
        Some(Cell::Value(v)) => Some(gradflow_core::detect::sci(widen_for_display(v))),
        _ => None,
    }
}

/// `12,345`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// "3 s ago", "5 min ago", "2 h ago", "4 d ago".
pub fn ago(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 90.0 {
        format!("{} s ago", s.round() as u64)
    } else if s < 90.0 * 60.0 {
        format!("{} min ago", (s / 60.0).round() as u64)
    } else if s < 36.0 * 3600.0 {
        format!("{} h ago", (s / 3600.0).round() as u64)
    } else {
        format!("{} d ago", (s / 86400.0).round() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
    }

    #[test]
    fn numbers_keep_zero_and_non_finite_visible() {
        assert_eq!(number(Some(Cell::Value(0.0))).as_deref(), Some("0.00e0"));
        assert_eq!(number(Some(Cell::Value(f32::NAN))).as_deref(), Some("NaN"));
        assert_eq!(number(Some(Cell::Null)), None);
        assert_eq!(number(None), None);
    }

    #[test]
    fn ago_picks_a_unit() {
        assert_eq!(ago(3.2), "3 s ago");
        assert_eq!(ago(600.0), "10 min ago");
        assert_eq!(ago(7200.0), "2 h ago");
        assert_eq!(ago(3.0 * 86400.0), "3 d ago");
    }
}
