//! How alert texts say numbers, steps and lists of names, the same way in every
//! detector.

/// `1.2e-5`-style formatting for the numbers in alert texts.
pub fn sci(value: f64) -> String {
    match gradflow_protocol::non_finite_spelling(value) {
        Some(s) => s.to_owned(),
        None => format!("{value:.2e}"),
    }
}

/// "steps 0–49", or "step 7" for one.
pub fn step_range(first: u64, last: u64) -> String {
    if first == last {
        format!("step {first}")
    } else {
        format!("steps {first}–{last}")
    }
}

/// Whether the dotted name `name` is `prefix` itself or lies under it
/// (`qwen.layers.0` is within `qwen`; `qwen2` is not).
pub fn is_within(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// A list of names for a person: at most `max`, then "and N more".
pub fn name_list(names: &[&str], max: usize) -> String {
    let shown: Vec<&str> = names.iter().take(max).copied().collect();
    let mut text = shown.join(", ");
    if names.len() > max {
        text.push_str(&format!(" and {} more", names.len() - max));
    }
    text
}
