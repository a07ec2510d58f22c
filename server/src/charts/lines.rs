//! Line charts: one or two value axes over steps, alert episodes shaded behind the
//! lines and labelled, NaN/Inf readings marked at the top (they cannot be plotted,
//! they must be seen), step markers (overflows) along the bottom, and reference
//! lines, every one inside the value axis. The legend goes over the plot, beside it
//! or under it ([`LegendPlace`]).
//!
//! Log axes draw log10 of the values on a linear axis with power-of-ten labels, so
//! one code path serves both; zeros (and negatives) sit on a floor one decade below
//! the smallest positive value, where a gradient stuck at 0 is plainly visible, each
//! line in its own lane a few pixels apart so that lines at 0 do not hide each other.
//! Linear axes label each tick with the digits that tell it from its neighbours.

use std::collections::BTreeSet;

use plotters::chart::DualCoordChartContext;
use plotters::coord::Shift;
use plotters::coord::types::{RangedCoordf64, RangedCoordu64};
use plotters::prelude::*;

use super::shapes::{Axis, LegendPlace, LineChart};
use super::{
    BAND, FONT, LABEL_SIZE, NON_FINITE, PALETTE, TITLE_SIZE, fit_from_the_end, plot_error,
    power_of_ten_label,
};

/// How an axis maps values to plot coordinates.
#[derive(Debug, Clone, Copy)]
struct Scale {
    log: bool,
    lo: f64,
    hi: f64,
    /// Where values ≤ 0 go on a log axis.
    floor: f64,
    /// On a log axis, how far apart the lines at 0 are drawn: each line with a
    /// zero gets its own lane at and below the floor, so none hides another.
    lane: f64,
}

/// A lane at the floor, as a share of a log axis's span (a few pixels).
const LANE_SHARE: f64 = 0.014;

impl Scale {
    /// The scale of `axis`, stretched to hold `extra` (reference values) too.
    fn of(axis: &Axis, extra: &[f64]) -> Option<Scale> {
        let values = axis
            .lines
            .iter()
            .flat_map(|l| l.points.iter().map(|(_, v)| *v))
            .chain(extra.iter().copied());
        if axis.log {
            let positives: Vec<f64> = values.filter(|v| *v > 0.0).map(f64::log10).collect();
            if !axis.lines.iter().any(|l| !l.points.is_empty()) && !only_nonfinite(axis) {
                return None;
            }
            let (lo, hi) = min_max(&positives).unwrap_or((-1.0, 0.0));
            let floor = lo.floor() - 1.0;
            let lanes = zero_lanes(axis).into_iter().flatten().count().clamp(1, 20);
            let span = hi + 0.3 - (floor - 0.3);
            let lane = LANE_SHARE * span / (1.0 - LANE_SHARE * (lanes - 1) as f64);
            Some(Scale {
                log: true,
                lo: floor - 0.3 - (lanes - 1) as f64 * lane,
                hi: hi + 0.3,
                floor,
                lane,
            })
        } else {
            let values: Vec<f64> = values.collect();
            // Readings that were all NaN or infinite still get an axis, to be marked on.
            let (lo, hi) = min_max(&values).or(only_nonfinite(axis).then_some((0.0, 1.0)))?;
            // A line that barely moves (a constant lr) gets a tenth of its value
            // each way, not ticks that differ in the fourth digit.
            let flat = hi - lo < hi.abs().max(lo.abs()) * 0.01;
            let share = if flat { 0.1 } else { 0.02 };
            let pad = ((hi - lo) * 0.06).max(hi.abs() * share).max(1e-12);
            Some(Scale {
                log: false,
                lo: lo - pad,
                hi: hi + pad,
                floor: lo,
                lane: 0.0,
            })
        }
    }

    fn map(&self, value: f64) -> f64 {
        self.map_in_lane(value, 0)
    }

    /// Where `value` of the line in zero lane `lane` is drawn.
    fn map_in_lane(&self, value: f64, lane: usize) -> f64 {
        if !self.log {
            value
        } else if value > 0.0 {
            value.log10()
        } else {
            self.floor - self.lane * lane.min(19) as f64
        }
    }

    fn label(&self, y: f64) -> String {
        if self.log && (y - self.floor).abs() < 1e-6 {
            // The floor stands for 0, not for 10^floor; below it there is nothing.
            "0".to_owned()
        } else if self.log && y < self.floor {
            String::new()
        } else if self.log {
            power_of_ten_label(y)
        } else {
            // Ticks are at least a tenth of the axis apart: digits down to a
            // twentieth of it tell every tick from its neighbours.
            let magnitude = self.hi.abs().max(self.lo.abs());
            linear_label(y, (self.hi - self.lo) / 20.0, magnitude)
        }
    }
}

/// `y` with the digits that tell apart values `resolution` apart, no more
/// (`0.0012`, `3.2`, `1.005e-5`), in scientific notation when the axis reaches
/// `magnitude` of 1e5 or more, or stays below 1e-3.
fn linear_label(y: f64, resolution: f64, magnitude: f64) -> String {
    if y.abs() < resolution / 2.0 {
        return "0".to_owned();
    }
    let finest = resolution.log10().floor();
    if !(1e-3..1e5).contains(&magnitude) {
        let digits = (y.abs().log10().floor() - finest).clamp(0.0, 15.0) as usize;
        let text = format!("{y:.digits$e}");
        match text.split_once('e') {
            Some((mantissa, exponent)) if mantissa.contains('.') => {
                let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
                format!("{mantissa}e{exponent}")
            }
            _ => text,
        }
    } else {
        let decimals = (-finest).clamp(0.0, 15.0) as usize;
        let text = format!("{y:.decimals$}");
        if text.contains('.') {
            text.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            text
        }
    }
}

/// Whether `axis` has readings, all of them NaN or infinite.
fn only_nonfinite(axis: &Axis) -> bool {
    axis.lines.iter().all(|l| l.points.is_empty())
        && axis.lines.iter().any(|l| !l.nonfinite.is_empty())
}

/// For each line of `axis`, its lane at the floor when it has a value ≤ 0.
fn zero_lanes(axis: &Axis) -> Vec<Option<usize>> {
    let mut next = 0;
    axis.lines
        .iter()
        .map(|line| {
            line.points.iter().any(|(_, v)| *v <= 0.0).then(|| {
                next += 1;
                next - 1
            })
        })
        .collect()
}

/// The legend's sample (the stretch of line before each entry), its box's margin,
/// and the gap between a legend beside the plot and the plot, in pixels.
const LEGEND_SAMPLE_PX: u32 = 30;
const LEGEND_MARGIN_PX: u32 = 10;
const LEGEND_GAP_PX: u32 = 10;
/// The space between two columns of a legend under the plot.
const LEGEND_COLUMN_GAP_PX: u32 = 16;
/// A row of a legend drawn beside the plot: the label font and some air.
pub(super) const LEGEND_ROW_PX: u32 = LABEL_SIZE + 8;
/// The chart's outer margin and its axes' label areas, in pixels.
const MARGIN_PX: u32 = 12;
const X_LABEL_PX: u32 = 40;
const Y_LABEL_PX: u32 = 72;

fn min_max(values: &[f64]) -> Option<(f64, f64)> {
    let mut it = values.iter().copied().filter(|v| v.is_finite());
    let first = it.next()?;
    Some(it.fold((first, first), |(lo, hi), v| (lo.min(v), hi.max(v))))
}

/// The chart's plotters context: steps against the primary axis, and the
/// secondary axis on the right.
type Plot<'a, DB> = DualCoordChartContext<
    'a,
    DB,
    Cartesian2d<RangedCoordu64, RangedCoordf64>,
    Cartesian2d<RangedCoordu64, RangedCoordf64>,
>;

/// What [`draw`] works out before drawing: the step range, the scales, and the
/// room the secondary axis and the legend take.
struct Frame {
    from: u64,
    to: u64,
    primary: Scale,
    secondary: Option<Scale>,
    /// Right of the plot: the secondary axis's labels.
    secondary_px: u32,
    /// Right of the plot: a legend beside it.
    legend_right_px: u32,
    /// Under the plot: a legend below it, and its columns.
    legend_below: Option<BelowLegend>,
}

/// A legend under the plot: entries in columns, filled row by row; an entry too
/// long for a column takes a row of its own.
#[derive(Debug, Clone, Copy)]
struct BelowLegend {
    columns: usize,
    column_px: u32,
    height_px: u32,
}

impl BelowLegend {
    fn of<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &LineChart) -> BelowLegend {
        let widths = label_widths(root, &legend_of(chart));
        let room = root
            .dim_in_pixel()
            .0
            .saturating_sub(2 * MARGIN_PX + 2 * LEGEND_MARGIN_PX);
        // Columns as wide as the widest entry that fits half the room.
        let half = (room + LEGEND_COLUMN_GAP_PX) / 2;
        let entry = |w: u32| w + LEGEND_SAMPLE_PX + LEGEND_COLUMN_GAP_PX;
        let column_px = widths
            .iter()
            .map(|w| entry(*w))
            .filter(|w| *w <= half)
            .max()
            .unwrap_or(half)
            .max(1);
        let columns = ((room + LEGEND_COLUMN_GAP_PX) / column_px).max(1) as usize;
        let rows = legend_cells(&widths, columns, column_px)
            .last()
            .map_or(0, |(_, row)| row + 1);
        BelowLegend {
            columns,
            column_px,
            height_px: rows as u32 * LEGEND_ROW_PX + 2 * LEGEND_MARGIN_PX,
        }
    }
}

/// The (column, row) of each entry of a legend in `columns` columns `column_px`
/// wide, whose labels are `widths` wide: filled row by row, an entry too wide for a
/// column alone on its row.
fn legend_cells(widths: &[u32], columns: usize, column_px: u32) -> Vec<(usize, usize)> {
    let (mut column, mut row) = (0, 0);
    let mut cells = Vec::with_capacity(widths.len());
    for &width in widths {
        let wide = columns > 1 && width + LEGEND_SAMPLE_PX + LEGEND_COLUMN_GAP_PX > column_px;
        if column > 0 && (wide || column == columns) {
            (column, row) = (0, row + 1);
        }
        cells.push((column, row));
        column = if wide { columns } else { column + 1 };
    }
    cells
}

/// The width of each legend label of `entries`, in pixels.
fn label_widths<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    entries: &[(String, Sample)],
) -> Vec<u32> {
    let font = TextStyle::from((FONT, LABEL_SIZE).into_font());
    entries
        .iter()
        .map(|(label, _)| root.estimate_text_size(label, &font).map_or(0, |(w, _)| w))
        .collect()
}

/// The widest legend label of `entries`, in pixels.
fn widest_label<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    entries: &[(String, Sample)],
) -> u32 {
    let font = TextStyle::from((FONT, LABEL_SIZE).into_font());
    entries
        .iter()
        .filter_map(|(label, _)| root.estimate_text_size(label, &font).ok())
        .map(|(w, _)| w)
        .max()
        .unwrap_or(0)
}

impl Frame {
    fn of<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &LineChart) -> Option<Frame> {
        // Every reference line is inside the axis: the chart is drawn to compare
        // them with the lines (an lr far below the smallest change bf16 can make).
        let references: Vec<f64> = chart.references.iter().map(|r| r.0).collect();
        let primary = Scale::of(&chart.primary, &references)?;
        let secondary = chart.secondary.as_ref().and_then(|a| Scale::of(a, &[]));
        // A legend beside the plot gets its own room: its widest entry, the sample
        // before it and the box's margins.
        let legend_right_px = match chart.legend {
            LegendPlace::Right => {
                widest_label(root, &legend_of(chart))
                    + LEGEND_SAMPLE_PX
                    + 2 * LEGEND_MARGIN_PX
                    + LEGEND_GAP_PX
            }
            LegendPlace::Inside | LegendPlace::Below | LegendPlace::None => 0,
        };
        Some(Frame {
            from: chart.from,
            to: chart.to.max(chart.from + 1),
            primary,
            secondary,
            secondary_px: if secondary.is_some() { 72 } else { 12 },
            legend_right_px,
            legend_below: (chart.legend == LegendPlace::Below)
                .then(|| BelowLegend::of(root, chart)),
        })
    }
}

pub fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &LineChart,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let Some(frame) = Frame::of(root, chart) else {
        return draw_empty(root, &chart.title, chart.from, chart.to);
    };
    let plot_area = match frame.legend_below {
        Some(below) => {
            let height = root.dim_in_pixel().1;
            root.split_vertically(height.saturating_sub(below.height_px + LEGEND_GAP_PX))
                .0
        }
        None => root.clone(),
    };
    let mut cc = draw_axes(&plot_area, chart, &frame)?;
    draw_bands(root, &mut cc, chart, &frame)?;
    draw_references(&mut cc, chart, &frame)?;
    draw_lines(&mut cc, chart, &frame)?;
    draw_marks(&mut cc, chart, &frame)?;
    draw_legend(root, &mut cc, chart, &frame)
}

/// The frame of the plot: caption, mesh, the step axis and the value axes.
fn draw_axes<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    chart: &LineChart,
    frame: &Frame,
) -> anyhow::Result<Plot<'a, DB>>
where
    DB::ErrorType: 'static,
{
    let (primary, secondary) = (frame.primary, frame.secondary);
    let mut cc = ChartBuilder::on(area)
        .caption(&chart.title, (FONT, TITLE_SIZE))
        .margin(MARGIN_PX)
        .x_label_area_size(X_LABEL_PX)
        .y_label_area_size(Y_LABEL_PX)
        .right_y_label_area_size(frame.secondary_px + frame.legend_right_px)
        .build_cartesian_2d(frame.from..frame.to, primary.lo..primary.hi)
        .map_err(plot_error)?
        .set_secondary_coord(
            frame.from..frame.to,
            secondary.map_or(0.0..1.0, |s| s.lo..s.hi),
        );
    // As many ticks as the plot has room for: a small panel gets fewer than a wide
    // chart, whose labels would otherwise run into each other.
    let (width_px, height_px) = area.dim_in_pixel();
    cc.configure_mesh()
        .x_labels((width_px / 80).clamp(3, 10) as usize)
        .y_labels((height_px / 40).clamp(3, 10) as usize)
        .x_desc("step")
        .y_desc(chart.primary.label.as_str())
        .y_label_formatter(&|y| primary.label(*y))
        .label_style((FONT, LABEL_SIZE))
        .axis_desc_style((FONT, LABEL_SIZE))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(plot_error)?;
    if let (Some(axis), Some(scale)) = (&chart.secondary, secondary) {
        cc.configure_secondary_axes()
            .y_desc(axis.label.as_str())
            .y_label_formatter(&|y| scale.label(*y))
            .label_style((FONT, LABEL_SIZE))
            .axis_desc_style((FONT, LABEL_SIZE))
            .draw()
            .map_err(plot_error)?;
    }
    Ok(cc)
}

/// Alert episodes behind everything, each labelled; one legend entry per label.
/// The labels go below the legend box (upper right), which would otherwise cover
/// the label of an episode that starts in the right part of the chart.
fn draw_bands<'a, DB: DrawingBackend + 'a>(
    root: &DrawingArea<DB, Shift>,
    cc: &mut Plot<'a, DB>,
    chart: &LineChart,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let primary = frame.primary;
    let plot_px = cc.plotting_area().dim_in_pixel().1;
    let references_px: Vec<f64> = chart
        .references
        .iter()
        .map(|(v, _)| {
            (primary.hi - primary.map(*v)) / (primary.hi - primary.lo) * f64::from(plot_px)
        })
        .collect();
    let label_top = LabelRows::below_legend(chart, plot_px, &references_px);
    let mut legended = BTreeSet::new();
    for (i, band) in chart.bands.iter().enumerate() {
        let series = cc
            .draw_series(std::iter::once(Rectangle::new(
                [(band.from, primary.lo), (band.to + 1, primary.hi)],
                BAND.mix(0.13).filled(),
            )))
            .map_err(plot_error)?;
        if legended.insert(band.label.clone()) {
            series
                .label(format!("shaded: {}", band.label))
                .legend(|(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 16, y + 5)], BAND.mix(0.3).filled())
                });
        }
        let font = (FONT, LABEL_SIZE).into_font().color(&BAND);
        let text_px = root
            .estimate_text_size(&band.label, &font)
            .map_or(0, |(w, _)| w as i32);
        let at = label_step(cc, band.from, text_px);
        cc.draw_series(std::iter::once(Text::new(
            band.label.clone(),
            // Stacked, so that bands starting at the same step keep readable labels.
            (
                at,
                primary.hi - (primary.hi - primary.lo) * label_top.fraction(i),
            ),
            font,
        )))
        .map_err(plot_error)?;
    }
    Ok(())
}

/// The colour of reference line `i`.
fn reference_colour(i: usize) -> RGBColor {
    [BLACK, RGBColor(120, 120, 120)][i % 2]
}

/// Horizontal dashed lines at the reference values.
fn draw_references<'a, DB: DrawingBackend + 'a>(
    cc: &mut Plot<'a, DB>,
    chart: &LineChart,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    for (i, (value, label)) in chart.references.iter().enumerate() {
        let y = frame.primary.map(*value);
        let colour = reference_colour(i);
        cc.draw_series(DashedLineSeries::new(
            vec![(frame.from, y), (frame.to, y)],
            6,
            4,
            colour.stroke_width(1),
        ))
        .map_err(plot_error)?
        .label(label.as_str())
        .legend(move |(x, y)| {
            plotters::element::DashedPathElement::new(
                vec![(x, y), (x + 16, y)],
                5,
                3,
                colour.stroke_width(1),
            )
        });
    }
    Ok(())
}

/// The lines of both axes. Past the palette's ten colours the lines are dashed,
/// so that no two look the same (a chart of sixteen ranks).
fn draw_lines<'a, DB: DrawingBackend + 'a>(
    cc: &mut Plot<'a, DB>,
    chart: &LineChart,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let primary = frame.primary;
    let lanes = zero_lanes(&chart.primary);
    for (i, line) in chart.primary.lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let width = line.width();
        let lane = lanes[i].unwrap_or(0);
        let points: Vec<(u64, f64)> = line
            .points
            .iter()
            .map(|(s, v)| (*s, primary.map_in_lane(*v, lane)))
            .collect();
        if sparse(cc, points.len()) {
            cc.draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(plot_error)?;
        }
        if i < PALETTE.len() {
            cc.draw_series(LineSeries::new(points, color.stroke_width(width)))
                .map_err(plot_error)?
                .label(line.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(width))
                });
        } else {
            cc.draw_series(DashedLineSeries::new(
                points,
                7,
                4,
                color.stroke_width(width),
            ))
            .map_err(plot_error)?
            .label(line.label.as_str())
            .legend(move |(x, y)| {
                plotters::element::DashedPathElement::new(
                    vec![(x, y), (x + 16, y)],
                    5,
                    3,
                    color.stroke_width(width),
                )
            });
        }
    }
    if let (Some(axis), Some(scale)) = (&chart.secondary, frame.secondary) {
        for (i, line) in axis.lines.iter().enumerate() {
            let color = PALETTE[(i + chart.primary.lines.len()) % PALETTE.len()];
            let points: Vec<(u64, f64)> = line
                .points
                .iter()
                .map(|(s, v)| (*s, scale.map(*v)))
                .collect();
            cc.draw_secondary_series(DashedLineSeries::new(points, 5, 3, color.stroke_width(2)))
                .map_err(plot_error)?
                .label(format!("{} (right axis)", line.label))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
    }
    Ok(())
}

/// Whether a line of `points` points is sparse enough on the plot to be drawn with a
/// dot at each: a value reported every few hundred steps, or once, is then seen
/// where it was measured (a line of one point draws nothing).
fn sparse<DB: DrawingBackend>(cc: &Plot<'_, DB>, points: usize) -> bool {
    let plot_px = cc.plotting_area().dim_in_pixel().0 as usize;
    points > 0 && points * 8 <= plot_px
}

/// NaN/Inf readings along the top, per line, and the step markers along the bottom.
fn draw_marks<'a, DB: DrawingBackend + 'a>(
    cc: &mut Plot<'a, DB>,
    chart: &LineChart,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let primary = frame.primary;
    let lines = chart
        .primary
        .lines
        .iter()
        .chain(chart.secondary.iter().flat_map(|a| a.lines.iter()));
    for line in lines.filter(|l| !l.nonfinite.is_empty()) {
        cc.draw_series(
            line.nonfinite
                .iter()
                .map(|s| Cross::new((*s, primary.hi), 5, NON_FINITE.stroke_width(2))),
        )
        .map_err(plot_error)?
        .label(format!("{}: NaN/Inf", line.label))
        .legend(|(x, y)| Cross::new((x + 8, y), 5, NON_FINITE.stroke_width(2)));
    }
    for (i, (label, steps)) in chart
        .markers
        .iter()
        .enumerate()
        .filter(|(_, (_, s))| !s.is_empty())
    {
        let color = marker_colour(i);
        let y = primary.lo + (primary.hi - primary.lo) * (0.03 + 0.04 * i as f64);
        cc.draw_series(
            steps
                .iter()
                .map(|s| TriangleMarker::new((*s, y), 5, color.filled())),
        )
        .map_err(plot_error)?
        .label(label.as_str())
        .legend(move |(x, y)| TriangleMarker::new((x + 8, y), 5, color.filled()));
    }
    Ok(())
}

/// The colour of marker row `i`.
fn marker_colour(i: usize) -> RGBColor {
    [BAND, RGBColor(255, 127, 14)][i % 2]
}

/// The legend where the chart wants it: plotters' own over the plot, or a box of
/// ours beside or under it.
fn draw_legend<'a, DB: DrawingBackend + 'a>(
    root: &DrawingArea<DB, Shift>,
    cc: &mut Plot<'a, DB>,
    chart: &LineChart,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (xs, ys) = cc.plotting_area().get_pixel_range();
    match (chart.legend, frame.legend_below) {
        (LegendPlace::Inside, _) => {
            for note in &chart.notes {
                cc.draw_series(std::iter::empty::<PathElement<(u64, f64)>>())
                    .map_err(plot_error)?
                    .label(note.as_str())
                    .legend(EmptyElement::at);
            }
            cc.configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(160, 160, 160))
                .label_font((FONT, LABEL_SIZE))
                .draw()
                .map_err(plot_error)
        }
        // plotters clips shapes to the plotting area, so a legend beside or under it
        // is drawn here, on the whole chart, entry by entry.
        (LegendPlace::Right, _) => draw_legend_box(
            root,
            chart,
            (
                xs.end + frame.secondary_px as i32 + LEGEND_GAP_PX as i32,
                ys.start,
            ),
            1,
            0,
        ),
        (LegendPlace::Below, Some(below)) => {
            let height = root.dim_in_pixel().1 as i32;
            draw_legend_box(
                root,
                chart,
                (
                    MARGIN_PX as i32,
                    height - MARGIN_PX as i32 / 2 - below.height_px as i32,
                ),
                below.columns,
                below.column_px,
            )
        }
        (LegendPlace::Below, None) | (LegendPlace::None, _) => Ok(()),
    }
}

/// The sample drawn before a legend entry, as [`draw`] draws its series.
#[derive(Debug, Clone, Copy)]
enum Sample {
    Line {
        color: RGBColor,
        width: u32,
        dashed: bool,
    },
    Band,
    NonFinite,
    Marker(RGBColor),
    /// A note: no sample.
    Nothing,
}

/// The legend's entries with their samples, in the order [`draw`] adds them.
fn legend_of(chart: &LineChart) -> Vec<(String, Sample)> {
    let mut entries: Vec<(String, Sample)> = Vec::new();
    let mut bands = BTreeSet::new();
    for band in &chart.bands {
        if bands.insert(band.label.as_str()) {
            entries.push((format!("shaded: {}", band.label), Sample::Band));
        }
    }
    for (i, (_, label)) in chart.references.iter().enumerate() {
        entries.push((
            label.clone(),
            Sample::Line {
                color: reference_colour(i),
                width: 1,
                dashed: true,
            },
        ));
    }
    for (i, line) in chart.primary.lines.iter().enumerate() {
        entries.push((
            line.label.clone(),
            Sample::Line {
                color: PALETTE[i % PALETTE.len()],
                width: line.width(),
                dashed: i >= PALETTE.len(),
            },
        ));
    }
    let first_secondary = chart.primary.lines.len();
    for (i, line) in chart
        .secondary
        .iter()
        .flat_map(|a| a.lines.iter())
        .enumerate()
    {
        entries.push((
            format!("{} (right axis)", line.label),
            Sample::Line {
                color: PALETTE[(i + first_secondary) % PALETTE.len()],
                width: 2,
                dashed: false,
            },
        ));
    }
    for line in chart
        .primary
        .lines
        .iter()
        .chain(chart.secondary.iter().flat_map(|a| a.lines.iter()))
        .filter(|l| !l.nonfinite.is_empty())
    {
        entries.push((format!("{}: NaN/Inf", line.label), Sample::NonFinite));
    }
    for (i, (label, steps)) in chart.markers.iter().enumerate() {
        if !steps.is_empty() {
            entries.push((label.clone(), Sample::Marker(marker_colour(i))));
        }
    }
    for note in &chart.notes {
        entries.push((note.clone(), Sample::Nothing));
    }
    entries
}

/// A legend box with its top left corner at `at` (pixels of `root`): its entries
/// in `columns` columns `column_px` apart, filled row by row, each its sample then
/// its label, like plotters' own.
fn draw_legend_box<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &LineChart,
    at: (i32, i32),
    columns: usize,
    column_px: u32,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let entries = legend_of(chart);
    if entries.is_empty() {
        return Ok(());
    }
    let font = TextStyle::from((FONT, LABEL_SIZE).into_font());
    let widest = widest_label(root, &entries) as i32;
    let (margin, sample, row) = (
        LEGEND_MARGIN_PX as i32,
        LEGEND_SAMPLE_PX as i32,
        LEGEND_ROW_PX as i32,
    );
    let widths = label_widths(root, &entries);
    let cells = legend_cells(&widths, columns.max(1), column_px);
    let rows = cells.last().map_or(0, |(_, row)| row + 1) as i32;
    // As wide as its widest row.
    let right = cells
        .iter()
        .zip(&widths)
        .map(|((column, _), w)| *column as i32 * column_px as i32 + *w as i32)
        .max()
        .unwrap_or(widest);
    let (x, y) = at;
    let (width, height) = (right + sample + 2 * margin, rows * row + 2 * margin);
    root.draw(&Rectangle::new(
        [(x, y), (x + width, y + height)],
        WHITE.mix(0.85).filled(),
    ))
    .map_err(plot_error)?;
    root.draw(&Rectangle::new(
        [(x, y), (x + width, y + height)],
        RGBColor(160, 160, 160),
    ))
    .map_err(plot_error)?;
    for ((label, kind), (column, line)) in entries.iter().zip(cells) {
        let left = x + margin + column as i32 * column_px as i32;
        let top = y + margin + line as i32 * row;
        draw_sample(root, *kind, (left, top + row / 2))?;
        root.draw(&Text::new(
            label.clone(),
            (left + sample, top + (row - LABEL_SIZE as i32) / 2 - 1),
            font.clone(),
        ))
        .map_err(plot_error)?;
    }
    Ok(())
}

/// A legend entry's sample, its left end at `(sx, sy)`.
fn draw_sample<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    kind: Sample,
    (sx, sy): (i32, i32),
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    match kind {
        Sample::Line {
            color,
            width,
            dashed: false,
        } => root.draw(&PathElement::new(
            vec![(sx, sy), (sx + 16, sy)],
            color.stroke_width(width),
        )),
        Sample::Line {
            color,
            width,
            dashed: true,
        } => root.draw(&plotters::element::DashedPathElement::new(
            vec![(sx, sy), (sx + 16, sy)],
            5,
            3,
            color.stroke_width(width),
        )),
        Sample::Band => root.draw(&Rectangle::new(
            [(sx, sy - 5), (sx + 16, sy + 5)],
            BAND.mix(0.3).filled(),
        )),
        Sample::NonFinite => root.draw(&Cross::new((sx + 8, sy), 5, NON_FINITE.stroke_width(2))),
        Sample::Marker(color) => root.draw(&TriangleMarker::new((sx + 8, sy), 5, color.filled())),
        Sample::Nothing => Ok(()),
    }
    .map_err(plot_error)
}

/// The step an episode label starting at `from` is drawn at: `from`, or further
/// left when a label `text_px` wide would run past the plotting area's right edge
/// (an episode still open at the last step).
fn label_step<DB: DrawingBackend>(
    cc: &ChartContext<'_, DB, Cartesian2d<RangedCoordu64, RangedCoordf64>>,
    from: u64,
    text_px: i32,
) -> u64 {
    let (xs, _) = cc.plotting_area().get_pixel_range();
    let (x, _) = cc.backend_coord(&(from, 0.0));
    // A few pixels to spare: a browser lays the text out with its own font.
    let limit = xs.end - 6 - text_px;
    if x <= limit || xs.end <= xs.start {
        return from;
    }
    let (lo, hi) = {
        let range = cc.x_range();
        (range.start, range.end)
    };
    let fraction = f64::from((limit - xs.start).max(0)) / f64::from(xs.end - xs.start);
    lo + (fraction * (hi - lo) as f64).floor() as u64
}

/// Where the episode labels go: rows from the top of the plotting area, starting
/// under the legend box when the legend leaves room, else at the top.
struct LabelRows {
    /// The tops of the rows a label may take, in pixels below the plot's top.
    rows_px: Vec<f64>,
    plot_px: f64,
}

/// How many entries the chart's legend has.
pub fn legend_entries(chart: &LineChart) -> usize {
    legend_of(chart).len()
}

impl LabelRows {
    /// Rows under the legend when it is over the plot, none crossing a reference
    /// line (at `references_px` below the plot's top), where a label would be
    /// struck through.
    fn below_legend(chart: &LineChart, plot_px: u32, references_px: &[f64]) -> LabelRows {
        let entries = legend_entries(chart);
        // plotters' legend: a row per entry at the label font's size plus spacing,
        // inside a box with a margin.
        let row_px = f64::from(LABEL_SIZE) + 8.0;
        let legend_px = entries as f64 * row_px + 16.0;
        let plot_px = f64::from(plot_px.max(1));
        let first_px = if chart.legend != LegendPlace::Inside {
            // The legend is beside or under the plot: the labels start at its top.
            4.0
        } else if legend_px + 3.0 * row_px < plot_px {
            legend_px + 4.0
        } else {
            4.0
        };
        let room = ((plot_px - first_px) / row_px).floor().max(1.0) as usize;
        // Rows are half a row apart, so that one dodging a line stays close.
        let all: Vec<f64> = (0..2 * room - 1)
            .map(|k| first_px + k as f64 * row_px / 2.0)
            .collect();
        let mut rows_px: Vec<f64> = Vec::new();
        for top in all.iter().copied() {
            let clear = references_px
                .iter()
                .all(|r| *r < top - 6.0 || *r > top + row_px - 4.0);
            if clear && rows_px.last().is_none_or(|last| top - last >= row_px) {
                rows_px.push(top);
            }
        }
        if rows_px.is_empty() {
            rows_px.push(first_px);
        }
        LabelRows { rows_px, plot_px }
    }

    /// How far below the top, as a fraction of the plotting area's height, label `i`
    /// starts (wrapping back up rather than leaving the area).
    fn fraction(&self, i: usize) -> f64 {
        self.rows_px[i % self.rows_px.len()] / self.plot_px
    }
}

/// A chart with nothing to show says so, with its title and step range.
pub fn draw_empty<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    from: u64,
    to: u64,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (width, height) = root.dim_in_pixel();
    let title_font = TextStyle::from((FONT, TITLE_SIZE).into_font());
    let title = fit_from_the_end(root, title, &title_font, width as i32 - 24);
    root.draw(&Text::new(title, (12, 12), title_font))
        .map_err(plot_error)?;
    let font = (FONT, LABEL_SIZE + 2)
        .into_font()
        .color(&RGBColor(90, 90, 90));
    // Centred, and shorter where the long form does not fit (a small panel).
    let message = [
        format!("Nothing reported for this chart in steps {from}–{to}."),
        format!("Nothing reported in steps {from}–{to}."),
    ]
    .into_iter()
    .map(|text| {
        let px = root
            .estimate_text_size(&text, &font)
            .map_or(0, |(w, _)| w as i32);
        (text, px)
    })
    .find(|(_, px)| *px <= width as i32 - 8);
    if let Some((message, px)) = message {
        root.draw(&Text::new(
            message,
            ((width as i32 - px) / 2, height as i32 / 2),
            font,
        ))
        .map_err(plot_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::charts::shapes::{Axis, Band, ChartData, Line};
    use crate::charts::{Format, render};

    /// The number after `name="` in an SVG element's text.
    fn attr(element: &str, name: &str) -> f64 {
        let start = element.find(&format!(" {name}=\"")).expect(name) + name.len() + 3;
        let end = start + element[start..].find('"').unwrap();
        element[start..end].parse().unwrap()
    }

    #[test]
    fn an_episode_open_at_the_last_step_keeps_its_label_inside_the_chart() {
        let chart = LineChart {
            title: "t".into(),
            from: 0,
            to: 139,
            primary: Axis {
                label: "loss".into(),
                log: false,
                lines: vec![Line {
                    label: "loss".into(),
                    points: (0..139).map(|s| (s, 2.0 - s as f64 / 100.0)).collect(),
                    nonfinite: vec![139],
                    emphasis: false,
                }],
            },
            secondary: None,
            bands: vec![Band {
                from: 139,
                to: 139,
                label: "loss_nonfinite: loss".into(),
            }],
            markers: vec![],
            references: vec![],
            notes: vec![],
            legend: LegendPlace::Inside,
        };
        for width in [600, 1200] {
            let svg = render(&ChartData::Lines(chart.clone()), Format::Svg, width, 420).unwrap();
            let svg = String::from_utf8(svg).unwrap();
            let label_at = svg.find("\nloss_nonfinite: loss\n").expect("the label");
            let text = &svg[svg[..label_at].rfind("<text").unwrap()..label_at];
            let font = (FONT, LABEL_SIZE).into_font();
            let (text_px, _) = font.box_size("loss_nonfinite: loss").unwrap();
            let right = attr(text, "x") + f64::from(text_px);
            assert!(
                right < f64::from(width) - 12.0,
                "{width}: the label ends at x {right}"
            );
        }
    }

    #[test]
    fn an_episode_label_is_never_under_the_legend() {
        let line = |label: &str| Line {
            label: label.into(),
            points: (0..100).map(|s| (s, 1.0 + s as f64 / 100.0)).collect(),
            nonfinite: vec![],
            emphasis: false,
        };
        let chart = LineChart {
            title: "t".into(),
            from: 0,
            to: 99,
            primary: Axis {
                label: "drift".into(),
                log: false,
                lines: vec![line("a"), line("b"), line("c"), line("d")],
            },
            secondary: None,
            // An episode that starts where the legend box is (upper right).
            bands: vec![Band {
                from: 80,
                to: 99,
                label: "norm_weight_frozen: agent".into(),
            }],
            markers: vec![],
            references: vec![],
            notes: vec![],
            legend: LegendPlace::Inside,
        };
        for (width, height) in [(600, 420), (1200, 420), (400, 300)] {
            let svg = render(&ChartData::Lines(chart.clone()), Format::Svg, width, height).unwrap();
            let svg = String::from_utf8(svg).unwrap();
            let legend = svg
                .split('<')
                .find(|e| e.starts_with("rect") && e.contains("opacity=\"0.85\""))
                .expect("the legend's box");
            let bottom = attr(legend, "y") + attr(legend, "height");
            let label_at = svg
                .find("\nnorm_weight_frozen: agent\n")
                .expect("the label");
            let text = &svg[svg[..label_at].rfind("<text").unwrap()..label_at];
            assert!(
                attr(text, "y") > bottom,
                "{width}×{height}: label at y {} under the legend ending at {bottom}",
                attr(text, "y")
            );
        }
    }

    #[test]
    fn a_legend_beside_the_plot_holds_every_entry_inside_the_chart() {
        let lines: Vec<Line> = (0..16)
            .map(|r| Line {
                label: format!("rank {r}"),
                points: (0..50).map(|s| (s, 0.1 + r as f64 * 0.01)).collect(),
                nonfinite: vec![],
                emphasis: false,
            })
            .collect();
        let chart = LineChart {
            title: "t".into(),
            from: 0,
            to: 49,
            primary: Axis {
                label: "seconds".into(),
                log: false,
                lines,
            },
            secondary: None,
            bands: vec![Band {
                from: 10,
                to: 49,
                label: "rank_straggler: rank 15".into(),
            }],
            markers: vec![],
            references: vec![],
            notes: vec!["4 more ranks not drawn: 16–19".into()],
            legend: LegendPlace::Right,
        };
        let height = 18 * LEGEND_ROW_PX + 140;
        for width in [600, 1200] {
            let svg = render(&ChartData::Lines(chart.clone()), Format::Svg, width, height).unwrap();
            let svg = String::from_utf8(svg).unwrap();
            let legend = svg
                .split('<')
                .find(|e| e.starts_with("rect") && e.contains("opacity=\"0.85\""))
                .expect("the legend's box");
            let (left, right) = (attr(legend, "x"), attr(legend, "x") + attr(legend, "width"));
            let bottom = attr(legend, "y") + attr(legend, "height");
            assert!(
                right <= f64::from(width),
                "{width}: the legend ends at x {right}"
            );
            assert!(
                bottom <= f64::from(height),
                "{width}: the legend ends at y {bottom}"
            );
            // Beside the plot: no line point lies under the box.
            for element in svg.split('<').filter(|e| e.starts_with("polyline")) {
                let start = element.find(" points=\"").unwrap() + 9;
                let points = element[start..].split('"').next().unwrap();
                if points.split_whitespace().count() > 2 {
                    for point in points.split_whitespace() {
                        let x: f64 = point.split(',').next().unwrap().parse().unwrap();
                        assert!(
                            x < left,
                            "{width}: a line at x {x} under the legend at {left}"
                        );
                    }
                }
            }
            for entry in [
                "rank 0",
                "rank 15",
                "shaded: rank_straggler: rank 15",
                "4 more ranks not drawn: 16–19",
            ] {
                assert!(
                    svg.contains(&format!("\n{entry}\n")),
                    "{width}: no {entry:?}"
                );
            }
        }
    }
}
