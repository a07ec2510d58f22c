//! Checks shared by the registration and the step record.

use crate::error::{InvalidBody, Path};
use crate::float::Float;
use crate::limits::MAX_NAME_BYTES;

/// A module, parameter, group or metric name: 1 to 512 bytes, no control characters.
pub(crate) fn check_name(path: &Path<'_>, name: &str) -> Result<(), InvalidBody> {
    if name.is_empty() {
        return Err(path.error("name must not be empty"));
    }
    check_text(path, name, MAX_NAME_BYTES)
}

/// Free text (a run's name, a host): at most `max_bytes`, no control characters.
pub(crate) fn check_text(path: &Path<'_>, text: &str, max_bytes: usize) -> Result<(), InvalidBody> {
    if text.len() > max_bytes {
        return Err(path.error(format!(
            "{} bytes is longer than the limit of {max_bytes}",
            text.len()
        )));
    }
    if let Some(c) = text.chars().find(|c| c.is_control()) {
        return Err(path.error(format!(
            "contains the control character {:?}",
            c.escape_unicode().to_string()
        )));
    }
    Ok(())
}

/// A norm is never negative; NaN and +Infinity are legal readings (that is what the
/// detectors look for), −Infinity and negative numbers are client bugs.
pub(crate) fn check_norm(path: &Path<'_>, value: Option<Float>) -> Result<(), InvalidBody> {
    match value {
        Some(v) if v.get() < 0.0 => Err(path.error(format!(
            "a norm cannot be negative, got {}",
            crate::format_float(v.get())
        ))),
        _ => Ok(()),
    }
}
