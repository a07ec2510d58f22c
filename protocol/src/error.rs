//! The one error a parse or a validation returns: what was wrong, and where.

use std::fmt;

/// An invalid body: `path` names the first bad field the way docs/PROTOCOL.md writes it
/// (`steps[3].modules[0].grad_norm`, `params[2].dtype`); it is empty when the body as a
/// whole is wrong (not JSON at all, say).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct InvalidBody {
    pub path: String,
    pub message: String,
}

impl InvalidBody {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidBody {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for InvalidBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Builds field paths while validating, so every check names where it failed.
pub(crate) struct Path<'a> {
    parent: Option<&'a Path<'a>>,
    segment: Segment<'a>,
}

enum Segment<'a> {
    Root(&'a str),
    Field(&'a str),
    Index(usize),
}

impl<'a> Path<'a> {
    pub(crate) fn root(name: &'a str) -> Self {
        Path {
            parent: None,
            segment: Segment::Root(name),
        }
    }

    pub(crate) fn field(&'a self, name: &'a str) -> Path<'a> {
        Path {
            parent: Some(self),
            segment: Segment::Field(name),
        }
    }

    pub(crate) fn index(&'a self, index: usize) -> Path<'a> {
        Path {
            parent: Some(self),
            segment: Segment::Index(index),
        }
    }

    pub(crate) fn error(&self, message: impl Into<String>) -> InvalidBody {
        InvalidBody::new(self.to_string(), message)
    }
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(parent) = self.parent {
            parent.fmt(f)?;
        }
        match self.segment {
            Segment::Root(name) => f.write_str(name),
            Segment::Field(name) if self.parent.is_some_and(|p| !p.is_empty_root()) => {
                write!(f, ".{name}")
            }
            Segment::Field(name) => f.write_str(name),
            Segment::Index(i) => write!(f, "[{i}]"),
        }
    }
}

impl Path<'_> {
    fn is_empty_root(&self) -> bool {
        matches!(self.segment, Segment::Root(""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_read_like_the_protocol_writes_them() {
        let root = Path::root("steps");
        let step = root.index(3);
        let modules = step.field("modules");
        let module = modules.index(0);
        assert_eq!(
            module.field("grad_norm").to_string(),
            "steps[3].modules[0].grad_norm"
        );
        let body = Path::root("");
        assert_eq!(body.field("params").index(2).to_string(), "params[2]");
    }
}
