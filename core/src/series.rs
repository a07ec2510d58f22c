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

/// A step range cut into equal buckets, the last one possibly shorter: the
/// downsampler's buckets, and the columns of a chart that must put every point in
/// the bucket the downsampler kept it for (a heatmap: a column that got no point
/// reads "not measured").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets {
    /// The first step of the first bucket.
    pub from: u64,
    /// The last step covered (the last bucket ends here).
    pub to: u64,
    /// Steps per bucket.
    pub width: u64,
    /// How many buckets: `ceil((to - from + 1) / width)`.
    pub count: usize,
}

impl Buckets {
    /// At most `max_count` (≥ 1) buckets over `from..=to`, as narrow as that allows
    /// and never narrower than a step.
    pub fn new(from: u64, to: u64, max_count: usize) -> Buckets {
        assert!(from <= to);
        let span = to - from + 1;
        let wanted = (max_count as u64).clamp(1, span);
        let width = span.div_ceil(wanted);
        Buckets {
            from,
            to,
            width,
            count: span.div_ceil(width) as usize,
        }
    }

    /// The bucket holding `step`, if the range covers it.
    pub fn index(&self, step: u64) -> Option<usize> {
        if step > self.to {
            return None;
        }
        let index = step.checked_sub(self.from)? / self.width;
        Some(index as usize)
    }

    /// The steps the buckets would cover if the last one were whole: a chart's step
    /// axis, whose columns are all `width` steps wide.
    pub fn whole_span(&self) -> u64 {
        self.width * self.count as u64
    }
}

/// Reduces points in `from..=to` to at most `max_points` (≥ 2): the range is cut into
/// `max_points / 2` equal buckets ([`Buckets`]), each giving its minimum and maximum (or
/// its maximum and first NaN, or its first null when it holds nothing else). Every
/// bucket that was given a point gives at least one back, at one of its own steps.
pub struct MinMax {
    buckets: Buckets,
    kept: Vec<Bucket>,
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
        assert!(max_points >= 2);
        MinMax::over(Buckets::new(from, to, max_points / 2))
    }

    /// Reduces into `buckets`, two points at most from each.
    pub fn over(buckets: Buckets) -> MinMax {
        MinMax {
            buckets,
            kept: vec![Bucket::default(); buckets.count],
        }
    }

    pub fn add(&mut self, step: u64, cell: Cell) {
        let Some(bucket) = self
            .buckets
            .index(step)
            .and_then(|index| self.kept.get_mut(index))
        else {
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
        let mut points = Vec::with_capacity(self.kept.len() * 2);
        for bucket in self.kept {
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
    fn buckets_are_equal_and_cover_the_range() {
        let buckets = Buckets::new(0, 599, 266);
        assert_eq!((buckets.width, buckets.count), (3, 200));
        assert_eq!(buckets.index(0), Some(0));
        assert_eq!(buckets.index(599), Some(199));
        assert_eq!(buckets.index(600), None);
        assert_eq!(buckets.whole_span(), 600);
        // Fewer steps than buckets asked for: one step each.
        let short = Buckets::new(40, 60, 266);
        assert_eq!((short.width, short.count), (1, 21));
        assert_eq!(short.index(39), None);
        // The last bucket may be short.
        let ragged = Buckets::new(0, 600, 266);
        assert_eq!((ragged.width, ragged.count), (3, 201));
        assert_eq!(ragged.index(600), Some(200));
        assert_eq!(Buckets::new(7, 7, 0).count, 1);
    }

    /// Whatever the values, a bucket that was given a point gives one back, inside
    /// it: a chart with a column per bucket never shows a measured column as empty.
    #[test]
    fn every_bucket_given_a_point_keeps_one_of_its_own() {
        let buckets = Buckets::new(0, 599, 266);
        let mut minmax = MinMax::over(buckets);
        for step in 0..600u64 {
            // Values in no order, so the extremes fall anywhere in a bucket.
            minmax.add(step, Cell::Value(((step * 7919) % 113) as f32));
        }
        let mut seen = vec![0; buckets.count];
        for (step, _) in minmax.finish() {
            seen[buckets.index(step).unwrap()] += 1;
        }
        assert!(seen.iter().all(|n| (1..=2).contains(n)), "{seen:?}");
    }

    #[test]
    fn out_of_range_points_are_ignored() {
        let mut minmax = MinMax::new(10, 19, 4);
        minmax.add(9, Cell::Value(1.0));
        minmax.add(20, Cell::Value(1.0));
        assert!(minmax.finish().is_empty());
    }
}
