//! The column dictionary: which position in a run's packed step values holds which
//! series (a kind of value and its subject: `module_grad_norm` of
//! `qwen.layers.0.mlp`, `loss` of nothing).
//!
//! Positions are handed out in order of first appearance and never change, so a row
//! written early is simply shorter than one written later (its missing tail reads as
//! absent). The dictionary of each run is persisted in the `columns` table, in the
//! same transaction as the first row that uses a new column.

// Fx rather than SipHash: every value of every step looks its column up here
// (SipHash was 12 % of the server's CPU under the ingest benchmark). Fx gives no
// protection against crafted colliding names, but the names come only from clients
// allowed to write (by the ingest token, where one is set), who can load the server
// with big batches anyway.
use rustc_hash::FxHashMap as HashMap;

pub use crate::model::series_kind::SeriesKind;

/// A run's columns: (kind, subject) → position, and each position's kind.
#[derive(Debug, Clone, Default)]
pub struct ColumnDictionary {
    by_kind: HashMap<SeriesKind, HashMap<Box<str>, u32>>,
    /// The kind of each position (`None` for a position not restored yet): what a
    /// block groups its columns by.
    kinds: Vec<Option<SeriesKind>>,
    /// The subject of each position.
    subjects: Vec<Box<str>>,
    len: u32,
}

impl ColumnDictionary {
    pub fn column_count(&self) -> u32 {
        self.len
    }

    /// Each position's kind, in column order.
    pub fn kinds(&self) -> &[Option<SeriesKind>] {
        &self.kinds
    }

    /// What position `position` holds, when it is known.
    pub fn entry(&self, position: usize) -> Option<(SeriesKind, &str)> {
        let kind = (*self.kinds.get(position)?)?;
        Some((kind, self.subjects.get(position).map_or("", |s| s)))
    }

    fn set_entry(&mut self, position: u32, kind: SeriesKind, subject: &str) {
        let position = position as usize;
        if self.kinds.len() <= position {
            self.kinds.resize(position + 1, None);
            self.subjects.resize(position + 1, Box::from(""));
        }
        self.kinds[position] = Some(kind);
        self.subjects[position] = subject.into();
    }

    pub fn get(&self, kind: SeriesKind, subject: &str) -> Option<u32> {
        self.by_kind.get(&kind)?.get(subject).copied()
    }

    /// Adds a column at the next position; the caller guarantees it is new.
    pub fn push(&mut self, kind: SeriesKind, subject: &str) -> u32 {
        let position = self.len;
        let previous = self
            .by_kind
            .entry(kind)
            .or_default()
            .insert(subject.into(), position);
        debug_assert!(
            previous.is_none(),
            "column {kind:?} {subject:?} added twice"
        );
        self.set_entry(position, kind, subject);
        self.len += 1;
        position
    }

    /// Restores a column read back from the store at its recorded position.
    pub fn restore(&mut self, kind: SeriesKind, subject: &str, position: u32) {
        self.by_kind
            .entry(kind)
            .or_default()
            .insert(subject.into(), position);
        self.set_entry(position, kind, subject);
        self.len = self.len.max(position + 1);
    }
}

/// Hands out positions for one batch without touching the run's dictionary, so a
/// batch that fails to commit leaves no trace. [`ColumnAssigner::added`] lists what
/// to persist and then merge.
pub struct ColumnAssigner<'a> {
    base: &'a ColumnDictionary,
    added: ColumnDictionary,
    order: Vec<(SeriesKind, String)>,
    /// Per kind, the subjects the previous row asked for, in the order it asked,
    /// with their positions; and where the current row is in that order. A client
    /// sends its modules in the same order every step, so nearly every lookup is a
    /// comparison with the name expected next, without hashing it.
    recent: Vec<Vec<(Box<str>, u32)>>,
    cursor: Vec<usize>,
}

impl<'a> ColumnAssigner<'a> {
    pub fn new(base: &'a ColumnDictionary) -> Self {
        let added = ColumnDictionary {
            by_kind: HashMap::default(),
            kinds: Vec::new(),
            subjects: Vec::new(),
            len: base.column_count(),
        };
        ColumnAssigner {
            base,
            added,
            order: Vec::new(),
            recent: vec![Vec::new(); SeriesKind::ALL.len()],
            cursor: vec![0; SeriesKind::ALL.len()],
        }
    }

    /// A new row begins: the lookups follow the previous row's order again.
    pub fn begin_row(&mut self) {
        self.cursor.fill(0);
    }

    pub fn position(&mut self, kind: SeriesKind, subject: &str) -> u32 {
        let k = kind as usize;
        let (Some(recent), Some(cursor)) = (self.recent.get(k), self.cursor.get(k)) else {
            return self.lookup(kind, subject);
        };
        let at = *cursor;
        if let Some((name, position)) = recent.get(at)
            && **name == *subject
        {
            self.cursor[k] += 1;
            return *position;
        }
        let position = self.lookup(kind, subject);
        let recent = &mut self.recent[k];
        if at < recent.len() {
            recent[at] = (subject.into(), position);
        } else {
            recent.push((subject.into(), position));
        }
        self.cursor[k] += 1;
        position
    }

    fn lookup(&mut self, kind: SeriesKind, subject: &str) -> u32 {
        if let Some(position) = self.base.get(kind, subject) {
            return position;
        }
        if let Some(position) = self.added.get(kind, subject) {
            return position;
        }
        self.order.push((kind, subject.to_owned()));
        self.added.push(kind, subject)
    }

    pub fn column_count(&self) -> u32 {
        self.added.column_count()
    }

    /// The columns this batch added, with their positions, in order.
    pub fn added(self) -> Vec<(SeriesKind, String, u32)> {
        let first = self.base.column_count();
        self.order
            .into_iter()
            .enumerate()
            .map(|(i, (kind, subject))| (kind, subject, first + i as u32))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_the_same_order_find_their_columns_again() {
        let base = ColumnDictionary::default();
        let mut assigner = ColumnAssigner::new(&base);
        let names = ["a.x", "a.y", "b.z"];
        let first: Vec<u32> = names
            .iter()
            .map(|n| assigner.position(SeriesKind::ModuleGradNorm, n))
            .collect();
        assigner.begin_row();
        let again: Vec<u32> = names
            .iter()
            .map(|n| assigner.position(SeriesKind::ModuleGradNorm, n))
            .collect();
        assert_eq!(first, again);
        // Another order, a name left out, a new one: still the right columns.
        assigner.begin_row();
        assert_eq!(
            assigner.position(SeriesKind::ModuleGradNorm, "b.z"),
            first[2]
        );
        assert_eq!(assigner.position(SeriesKind::ModuleGradNorm, "c.w"), 3);
        assert_eq!(
            assigner.position(SeriesKind::ModuleGradNorm, "a.x"),
            first[0]
        );
        assert_eq!(assigner.position(SeriesKind::HookHits, "a.x"), 4);
        assert_eq!(assigner.column_count(), 5);
    }

    #[test]
    fn an_assigner_extends_without_touching_the_base() {
        let mut base = ColumnDictionary::default();
        base.push(SeriesKind::Loss, "");
        let mut assigner = ColumnAssigner::new(&base);
        assert_eq!(assigner.position(SeriesKind::Loss, ""), 0);
        assert_eq!(assigner.position(SeriesKind::ModuleGradNorm, "a"), 1);
        assert_eq!(assigner.position(SeriesKind::HookHits, "a"), 2);
        assert_eq!(assigner.position(SeriesKind::ModuleGradNorm, "a"), 1);
        assert_eq!(assigner.column_count(), 3);
        let added = assigner.added();
        assert_eq!(base.column_count(), 1);
        assert_eq!(
            added,
            vec![
                (SeriesKind::ModuleGradNorm, "a".to_owned(), 1),
                (SeriesKind::HookHits, "a".to_owned(), 2)
            ]
        );
    }
}
