//! The servers a run reports to, spoken to one at a time: the first until it stops
//! answering, then the next, and after the last the first again. A server that
//! comes back is not returned to while the one in use answers, so a flapping
//! primary does not split the run's traffic.

pub(super) struct Servers {
    urls: Vec<String>,
    current: usize,
    /// The server that answered last: another one answering is a move worth telling.
    answered: Option<usize>,
}

impl Servers {
    /// `urls` in order of preference; at least one.
    pub(super) fn new(urls: Vec<String>) -> Servers {
        assert!(!urls.is_empty(), "a reporter has at least one server");
        Servers {
            urls,
            current: 0,
            answered: None,
        }
    }

    /// The base URL of the server in use.
    pub(super) fn current(&self) -> &str {
        &self.urls[self.current]
    }

    pub(super) fn len(&self) -> usize {
        self.urls.len()
    }

    /// Every server, for a message: `a, b`.
    pub(super) fn list(&self) -> String {
        self.urls.join(", ")
    }

    /// Moves to the next server, after the last to the first; `false` when there is
    /// no other.
    pub(super) fn advance(&mut self) -> bool {
        if self.urls.len() < 2 {
            return false;
        }
        self.current = (self.current + 1) % self.urls.len();
        true
    }

    /// Notes that the server in use answered, and says so when it is not the one
    /// that answered before: the user learns where the run's steps now go.
    pub(super) fn answered(&mut self) {
        let previous = self.answered.replace(self.current);
        let to = &self.urls[self.current];
        match previous {
            Some(from) if from != self.current => tracing::warn!(
                "the gradflow server {} stopped answering: now reporting to {to}",
                self.urls[from]
            ),
            None if self.current != 0 => tracing::warn!(
                "the gradflow server {} does not answer: now reporting to {to}",
                self.urls[0]
            ),
            _ => {}
        }
    }
}
