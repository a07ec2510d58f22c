//! Downsampling for series reads, with no I/O: which sources cover a step range (raw
//! rows, rollup buckets), and a min/max accumulator that turns their points into at
//! most `max_points` points.
//!
//! Min/max per bucket keeps what a person must see: a single-step spike is the maximum
//! of its bucket, so it survives any reduction; a NaN replaces the bucket's minimum,
//! because a non-finite reading matters more than a dip.

use crate::model::cell::Cell;

/// Where the values of a step range come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Step rows `from..=to`.
    Raw { from: u64, to: u64 },
    /// Rollup buckets `first..=last` of the level with bucket `width`.
    Rollup { width: u64, first: u64, last: u64 },
}

/// Covers `from..=to` with the coarsest rollup buckets that fit whole inside it (of
/// the widths in `widths`, coarsest first) and raw rows at the ragged ends.
pub fn plan(from: u64, to: u64, widths: &[u64]) -> Vec<Source> {
    let mut sources = Vec::new();
    plan_into(from, to, widths, &mut sources);
    sources
}

fn plan_into(from: u64, to: u64, widths: &[u64], out: &mut Vec<Source>) {
    let Some((&width, finer)) = widths.split_first() else {
        out.push(Source::Raw { from, to });
        return;
    };
    let first = from.div_ceil(width);
    let end = (to + 1) / width; // buckets before `end` end at or before `to`
    if first >= end {
        plan_into(from, to, finer, out);
        return;
    }
    if from < first * width {
        plan_into(from, first * width - 1, finer, out);
    }
    out.push(Source::Rollup {
        width,
        first,
        last: end - 1,
    });
    if end * width <= to {
        plan_into(end * width, to, finer, out);
    }
}

/// Reduces points in `from..=to` to at most `max_points` (≥ 2): the range is cut into
/// `max_points / 2` equal buckets, each giving its minimum and maximum (or its maximum
/// and first NaN, or its first null when it holds nothing else).
pub struct MinMax {
    from: u64,
    width: u64,
    buckets: Vec<Bucket>,
}

#[derive(Clone, Copy, Default)]
struct Bucket {
    min: Option<(u64, f32)>,
    max: Option<(u64, f32)>,
    nan: Option<u64>,
    null: Option<u64>,
}

impl MinMax {
    pub fn new(from: u64, to: u64, max_points: usize) -> MinMax {
        assert!(max_points >= 2 && from <= to);
        let span = to - from + 1;
        let count = ((max_points / 2) as u64).min(span).max(1);
        let width = span.div_ceil(count);
        let count = span.div_ceil(width);
        MinMax {
            from,
            width,
            buckets: vec![Bucket::default(); count as usize],
        }
    }

    /// Bucket width in steps: rollup levels no wider than this keep full resolution.
    pub fn bucket_width(&self) -> u64 {
        self.width
    }

    pub fn add(&mut self, step: u64, cell: Cell) {
        let Some(index) = step
            .checked_sub(self.from)
            .map(|d| (d / self.width) as usize)
        else {
            return;
        };
        let Some(bucket) = self.buckets.get_mut(index) else {
            return;
        };
        match cell {
            Cell::Absent => {}
            Cell::Null => {
                bucket.null = Some(bucket.null.map_or(step, |s| s.min(step)));
            }
            Cell::Value(v) if v.is_nan() => {
                bucket.nan = Some(bucket.nan.map_or(step, |s| s.min(step)));
            }
            Cell::Value(v) => {
                if bucket
                    .min
                    .is_none_or(|(s, m)| v < m || (v == m && step < s))
                {
                    bucket.min = Some((step, v));
                }
                if bucket
                    .max
                    .is_none_or(|(s, m)| v > m || (v == m && step < s))
                {
                    bucket.max = Some((step, v));
                }
            }
        }
    }

    pub fn finish(self) -> Vec<(u64, Cell)> {
        let mut points = Vec::with_capacity(self.buckets.len() * 2);
        for bucket in self.buckets {
            // `min` and `max` are set together: a bucket with one number has both.
            let mut pair: [Option<(u64, Cell)>; 2] = match (bucket.min, bucket.max, bucket.nan) {
                (_, Some((s, v)), Some(nan)) => [
                    Some((s, Cell::Value(v))),
                    Some((nan, Cell::Value(f32::NAN))),
                ],
                (Some((s1, v1)), Some((s2, v2)), None) if s1 != s2 => {
                    [Some((s1, Cell::Value(v1))), Some((s2, Cell::Value(v2)))]
                }
                (_, Some((s, v)), None) => [Some((s, Cell::Value(v))), None],
                (_, None, Some(nan)) => [Some((nan, Cell::Value(f32::NAN))), None],
                (_, None, None) => [bucket.null.map(|s| (s, Cell::Null)), None],
            };
            if let [Some(a), Some(b)] = pair
                && b.0 < a.0
            {
                pair = [Some(b), Some(a)];
            }
            points.extend(pair.into_iter().flatten());
        }
        points
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_range_exactly_once() {
        let widths = [4096, 64];
        for (from, to) in [
            (0, 99_999),
            (5, 70),
            (1, 62),
            (64, 127),
            (100, 10_000),
            (0, 0),
        ] {
            let sources = plan(from, to, &widths);
            let mut next = from;
            for source in &sources {
                let (a, b) = match *source {
                    Source::Raw { from, to } => (from, to),
                    Source::Rollup { width, first, last } => {
                        (first * width, (last + 1) * width - 1)
                    }
                };
                assert_eq!(a, next, "{from}..={to}: {sources:?}");
                next = b + 1;
            }
            assert_eq!(next, to + 1, "{from}..={to}: {sources:?}");
        }
        assert_eq!(
            plan(0, 99_999, &widths),
            vec![
                Source::Rollup {
                    width: 4096,
                    first: 0,
                    last: 23
                },
                Source::Rollup {
                    width: 64,
                    first: 1536,
                    last: 1561
                },
                Source::Raw {
                    from: 99_968,
                    to: 99_999
                },
            ]
        );
        assert_eq!(plan(3, 9, &[]), vec![Source::Raw { from: 3, to: 9 }]);
    }

    #[test]
    fn a_single_step_spike_survives_any_reduction() {
        let mut minmax = MinMax::new(0, 99_999, 1000);
        for step in 0..100_000u64 {
            let v = if step == 31_337 {
                1e6
            } else {
                1.0 + (step % 7) as f32 * 0.01
            };
            minmax.add(step, Cell::Value(v));
        }
        let points = minmax.finish();
        assert!(points.len() <= 1000, "{}", points.len());
        assert!(points.contains(&(31_337, Cell::Value(1e6))));
        assert!(
            points.windows(2).all(|w| w[0].0 < w[1].0),
            "points are in step order"
        );
    }

    #[test]
    fn nan_and_null_are_kept_visible() {
        let mut minmax = MinMax::new(0, 9, 2);
        minmax.add(0, Cell::Value(1.0));
        minmax.add(3, Cell::Value(f32::NAN));
        minmax.add(5, Cell::Value(9.0));
        let points = minmax.finish();
        assert_eq!(points.len(), 2);
        assert_eq!(points[0].0, 3);
        assert!(matches!(points[0].1, Cell::Value(v) if v.is_nan()));
        assert_eq!(points[1], (5, Cell::Value(9.0)));

        let mut minmax = MinMax::new(0, 9, 4);
        minmax.add(1, Cell::Null);
        minmax.add(7, Cell::Null);
        assert_eq!(minmax.finish(), vec![(1, Cell::Null), (7, Cell::Null)]);
    }

    #[test]
    fn out_of_range_points_are_ignored() {
        let mut minmax = MinMax::new(10, 19, 4);
        minmax.add(9, Cell::Value(1.0));
        minmax.add(20, Cell::Value(1.0));
        assert!(minmax.finish().is_empty());
    }
}
