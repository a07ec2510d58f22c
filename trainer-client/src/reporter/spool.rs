//! The spool: where step records wait, in order, while no server takes them.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;

use gradflow_protocol::StepRecord;

/// A bounded, append-only NDJSON file of records waiting for the server.
pub(super) struct Spool {
    pub(super) path: PathBuf,
    max_bytes: u64,
    bytes: u64,
    pub(super) records: u64,
    pub(super) dropped: u64,
}

impl Spool {
    pub(super) fn open(path: PathBuf, max_bytes: u64) -> anyhow::Result<Spool> {
        // A spool left by an earlier process of the same run id is stale: that
        // process reported what it could not deliver.
        if path.exists() {
            std::fs::remove_file(&path)?;
        }
        Ok(Spool {
            path,
            max_bytes,
            bytes: 0,
            records: 0,
            dropped: 0,
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.records == 0
    }

    pub(super) fn append(&mut self, records: &[StepRecord]) -> std::io::Result<()> {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        for record in records {
            let mut line = serde_json::to_vec(record)?;
            line.push(b'\n');
            if self.bytes + line.len() as u64 > self.max_bytes {
                self.dropped += 1;
                continue;
            }
            file.write_all(&line)?;
            self.bytes += line.len() as u64;
            self.records += 1;
        }
        file.flush()
    }

    pub(super) fn read(&self) -> std::io::Result<Vec<StepRecord>> {
        let file = File::open(&self.path)?;
        let mut records = Vec::with_capacity(self.records as usize);
        for line in BufReader::new(file).lines() {
            let line = line?;
            if !line.is_empty() {
                records.push(serde_json::from_str(&line)?);
            }
        }
        Ok(records)
    }

    /// Replaces the spool with `remaining`.
    pub(super) fn keep_from(&mut self, remaining: &[StepRecord]) -> std::io::Result<()> {
        self.bytes = 0;
        self.records = 0;
        if remaining.is_empty() {
            if self.path.exists() {
                std::fs::remove_file(&self.path)?;
            }
            return Ok(());
        }
        File::create(&self.path)?;
        let dropped = self.dropped;
        self.append(remaining)?;
        self.dropped = dropped;
        Ok(())
    }
}
