//! The gradient-flow heatmap: modules (rows, in model order, grouped) by steps
//! (columns), colour = log10 of the gradient norm (viridis). Exact zeros, "no
//! gradient: backward never reached" and NaN/Inf each have their own colour, which no
//! norm can take, so a cut graph is a solid grey band at a glance.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::colors::colormaps::{ColorMap, ViridisRGB};

use super::lines::draw_empty;
use super::shapes::{FlowCell, GradFlow};
use super::{
    FONT, LABEL_SIZE, NON_FINITE, NOT_REACHED, TITLE_SIZE, ZERO, fit_from_the_end, plot_error,
    power_of_ten_label,
};

const TOP: i32 = 44;
const LEGEND: i32 = 70;
const AXIS: i32 = 36;
/// The label column's left edge, and the gap between the group and module labels.
const LABEL_LEFT: i32 = 6;
const LABEL_GAP: i32 = 10;

/// Where things go: the heatmap's cells, and left of them the group labels'
/// column then the module labels' column, which never share a pixel.
struct Frame {
    x0: i32,
    x1: i32,
    y0: i32,
    y1: i32,
    row_height: f64,
    column_width: f64,
    /// Where the module labels start, and how wide they may be.
    module_x: i32,
    module_px: i32,
    /// How wide the group labels may be.
    group_px: i32,
}

impl Frame {
    fn of<DB: DrawingBackend>(
        root: &DrawingArea<DB, Shift>,
        chart: &GradFlow,
        columns: usize,
    ) -> Frame {
        let (width, height) = root.dim_in_pixel();
        let (width, height) = (width as i32, height as i32);
        let measure = |text: &str, font: &TextStyle<'_>| {
            root.estimate_text_size(text, font)
                .map_or(0, |(w, _)| w as i32)
        };
        let group_style = group_font(LABEL_SIZE);
        let widest_group = groups(chart)
            .iter()
            .map(|(group, _, _)| measure(&group_label(group), &group_style))
            .max()
            .unwrap_or(0);
        let module_style = text_style(12);
        let widest_module = chart
            .modules
            .iter()
            .map(|(module, group)| measure(short_name(module, group), &module_style))
            .max()
            .unwrap_or(0);
        // As wide as the labels need, up to a third of the chart and a bit.
        let label_width = (LABEL_LEFT + widest_group + LABEL_GAP + widest_module + 6)
            .clamp(110, (f64::from(width) * 0.35).clamp(110.0, 420.0) as i32);
        let x0 = label_width + 6;
        let y0 = TOP;
        let y1 = (height - LEGEND - AXIS).max(y0 + chart.modules.len() as i32);
        // The group column is as wide as its widest label, unless the module
        // labels would not fit beside it: then it has half the room.
        let room = x0 - 6 - LABEL_LEFT - LABEL_GAP;
        let group_px = widest_group.min((room - widest_module).max(room / 2));
        let module_x = LABEL_LEFT + group_px + LABEL_GAP;
        Frame {
            x0,
            x1: width - 14,
            y0,
            y1,
            row_height: (y1 - y0) as f64 / chart.modules.len() as f64,
            column_width: (width - 14 - x0) as f64 / columns as f64,
            module_x,
            module_px: x0 - 6 - module_x,
            group_px,
        }
    }

    /// The top of row `r` (and the bottom of row `r - 1`).
    fn row_top(&self, r: usize) -> i32 {
        self.y0 + (r as f64 * self.row_height) as i32
    }

    /// The left edge of column `c` (and the right edge of column `c - 1`).
    fn column_left(&self, c: usize) -> i32 {
        self.x0 + (c as f64 * self.column_width) as i32
    }
}

/// The groups of the heatmap's rows in order: (group, first row, end row).
fn groups(chart: &GradFlow) -> Vec<(String, usize, usize)> {
    let mut out: Vec<(String, usize, usize)> = Vec::new();
    for (r, (_, group)) in chart.modules.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.0 == *group => last.2 = r + 1,
            _ => out.push((group.clone(), r, r + 1)),
        }
    }
    out
}

/// A module's name in its group's rows: without the group's prefix.
fn short_name<'a>(module: &'a str, group: &str) -> &'a str {
    module
        .strip_prefix(group)
        .and_then(|rest| rest.strip_prefix('.'))
        .unwrap_or(module)
}

fn group_label(group: &str) -> String {
    format!("[{group}]")
}

fn group_font(size: u32) -> TextStyle<'static> {
    TextStyle::from((FONT, size).into_font().style(FontStyle::Bold))
}

/// The colour scale: log10 of the smallest and largest positive norms.
#[derive(Debug, Clone, Copy)]
struct ColourScale {
    lo: f64,
    hi: f64,
}

impl ColourScale {
    fn of(chart: &GradFlow) -> ColourScale {
        let (mut lo, mut hi) = chart
            .cells
            .iter()
            .flatten()
            .filter_map(|c| match c {
                FlowCell::Norm(v) if *v > 0.0 => Some(v.log10()),
                _ => None,
            })
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        if !lo.is_finite() {
            (lo, hi) = (-1.0, 0.0);
        }
        if hi - lo < 1e-9 {
            (lo, hi) = (lo - 0.5, hi + 0.5);
        }
        ColourScale { lo, hi }
    }

    fn at(&self, log: f64) -> RGBColor {
        ViridisRGB.get_color_normalized(log as f32, self.lo as f32, self.hi as f32)
    }

    fn colour(&self, cell: FlowCell) -> Option<RGBColor> {
        match cell {
            FlowCell::Absent => None,
            FlowCell::NotReached => Some(NOT_REACHED),
            FlowCell::Zero => Some(ZERO),
            FlowCell::NonFinite => Some(NON_FINITE),
            FlowCell::Norm(v) => Some(self.at(v.log10())),
        }
    }
}

fn text_style(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().color(&BLACK)
}

pub fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &GradFlow,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let columns = chart.cells.first().map_or(0, Vec::len);
    if chart.modules.is_empty() || columns == 0 {
        return draw_empty(root, &chart.title, chart.from, chart.to);
    }
    root.draw(&Text::new(
        chart.title.clone(),
        (12, 10),
        (FONT, TITLE_SIZE),
    ))
    .map_err(plot_error)?;
    let frame = Frame::of(root, chart, columns);
    let scale = ColourScale::of(chart);
    draw_cells(root, chart, &frame, &scale)?;
    draw_row_labels(root, chart, &frame)?;
    draw_step_axis(root, chart, &frame)?;
    draw_legend(root, &scale)
}

/// A rectangle per measured cell, then the frame around them. A cell reaches a pixel
/// into a measured neighbour on its right and below: cells that only touch leave a
/// hairline of background between them once a browser scales the SVG, as white as
/// "not measured".
fn draw_cells<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &GradFlow,
    frame: &Frame,
    scale: &ColourScale,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let measured = |r: usize, c: usize| {
        chart
            .cells
            .get(r)
            .and_then(|row| row.get(c))
            .is_some_and(|cell| *cell != FlowCell::Absent)
    };
    for (r, row) in chart.cells.iter().enumerate() {
        let top = frame.row_top(r);
        let bottom = frame.row_top(r + 1).max(top + 1);
        for (c, cell) in row.iter().enumerate() {
            if let Some(fill) = scale.colour(*cell) {
                let left = frame.column_left(c);
                let right = frame.column_left(c + 1).max(left + 1);
                let right = right + i32::from(measured(r, c + 1));
                let bottom = bottom + i32::from(measured(r + 1, c));
                root.draw(&Rectangle::new(
                    [(left, top), (right, bottom)],
                    fill.filled(),
                ))
                .map_err(plot_error)?;
            }
        }
    }
    root.draw(&Rectangle::new(
        [(frame.x0, frame.y0), (frame.x1, frame.y1)],
        RGBColor(120, 120, 120).stroke_width(1),
    ))
    .map_err(plot_error)?;
    Ok(())
}

/// Group names and separators in the group column, module names (without their
/// group's prefix) in the module column when rows are tall enough to read. A group
/// name is as tall as its rows allow, and left out when even 7 px do not fit.
fn draw_row_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &GradFlow,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let label_size = (frame.row_height - 1.0).clamp(0.0, 12.0) as u32;
    for (group, first, end) in groups(chart) {
        let (top, bottom) = (frame.row_top(first), frame.row_top(end));
        root.draw(&PathElement::new(
            vec![(4, top), (frame.x1, top)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_error)?;
        let size = (bottom - top - 1).clamp(0, LABEL_SIZE as i32) as u32;
        if size < 7 {
            continue;
        }
        let font = group_font(size);
        let text = fit_from_the_end(root, &group_label(&group), &font, frame.group_px);
        root.draw(&Text::new(text, (LABEL_LEFT, top + 1), font.clone()))
            .map_err(plot_error)?;
    }
    if label_size < 7 {
        return Ok(());
    }
    let font = text_style(label_size);
    for (r, (module, group)) in chart.modules.iter().enumerate() {
        let short = fit_from_the_end(root, short_name(module, group), &font, frame.module_px);
        root.draw(&Text::new(
            short,
            (frame.module_x, frame.row_top(r)),
            text_style(label_size),
        ))
        .map_err(plot_error)?;
    }
    Ok(())
}

/// Step ticks at round numbers under the cells (the line charts' 0/50/100, not
/// 0/74/149), each at the left edge of its step's column, and the axis name.
fn draw_step_axis<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &GradFlow,
    frame: &Frame,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (x0, x1, y1) = (frame.x0, frame.x1, frame.y1);
    // The columns' steps: the last column is as wide as the others, even when the
    // run ends inside it.
    let columns = chart.cells.first().map_or(1, Vec::len) as u64;
    let steps = (chart.steps_per_column * columns).max(1);
    let font = text_style(LABEL_SIZE);
    for step in round_steps(chart.from, chart.to) {
        let x = x0 + ((x1 - x0) as f64 * (step - chart.from) as f64 / steps as f64) as i32;
        root.draw(&PathElement::new(
            vec![(x, y1), (x, y1 + 5)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_error)?;
        let label = step.to_string();
        let text_px = root
            .estimate_text_size(&label, &font)
            .map_or(0, |(w, _)| w as i32);
        root.draw(&Text::new(
            label,
            ((x - text_px / 2).min(x1 + 10 - text_px), y1 + 8),
            font.clone(),
        ))
        .map_err(plot_error)?;
    }
    root.draw(&Text::new(
        "step".to_owned(),
        ((x0 + x1) / 2 - 12, y1 + 22),
        font,
    ))
    .map_err(plot_error)?;
    Ok(())
}

/// Multiples of 1, 2 or 5 × 10^k from `from` to `to`, about six of them.
fn round_steps(from: u64, to: u64) -> Vec<u64> {
    let raw = ((to - from + 1) as f64 / 6.0).max(1.0);
    let magnitude = 10f64.powf(raw.log10().floor());
    let every = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|e| *e >= raw)
        .unwrap_or(10.0 * magnitude) as u64;
    let first = from.div_ceil(every) * every;
    (0..)
        .map(|i| first + i * every)
        .take_while(|s| *s <= to)
        .collect()
}

/// The legend: the colour scale, then the special states.
fn draw_legend<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    scale: &ColourScale,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let (width, height) = root.dim_in_pixel();
    let (width, height) = (width as i32, height as i32);
    let legend_top = height - LEGEND + 10;
    let bar_left = 12;
    let bar_width = 180;
    for i in 0..bar_width {
        let v = scale.lo + (scale.hi - scale.lo) * i as f64 / (bar_width - 1) as f64;
        root.draw(&Rectangle::new(
            [
                (bar_left + i, legend_top),
                (bar_left + i + 1, legend_top + 14),
            ],
            scale.at(v).filled(),
        ))
        .map_err(plot_error)?;
    }
    for (text, at) in [
        (power_of_ten_label(scale.lo), (bar_left, legend_top + 18)),
        (
            power_of_ten_label(scale.hi),
            (bar_left + bar_width - 30, legend_top + 18),
        ),
        (
            "gradient norm (log)".to_owned(),
            (bar_left + 40, legend_top + 34),
        ),
    ] {
        root.draw(&Text::new(text, at, text_style(LABEL_SIZE - 1)))
            .map_err(plot_error)?;
    }
    let swatches = [
        (ZERO, "exactly 0"),
        (NOT_REACHED, "no gradient: backward never reached"),
        (NON_FINITE, "NaN / Inf"),
        (WHITE, "not measured"),
    ];
    let mut x = bar_left + bar_width + 24;
    let mut y = legend_top;
    for (fill, label) in swatches {
        let label_width = (label.len() as f64 * (LABEL_SIZE as f64) * 0.55) as i32 + 34;
        if x + label_width > width - 8 {
            x = bar_left + bar_width + 24;
            y += 22;
        }
        root.draw(&Rectangle::new([(x, y), (x + 14, y + 14)], fill.filled()))
            .map_err(plot_error)?;
        root.draw(&Rectangle::new(
            [(x, y), (x + 14, y + 14)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_error)?;
        root.draw(&Text::new(
            label.to_owned(),
            (x + 20, y),
            text_style(LABEL_SIZE - 1),
        ))
        .map_err(plot_error)?;
        x += label_width;
    }
    Ok(())
}

/// The height that gives each module a readable row.
pub fn natural_height(modules: usize) -> u32 {
    let rows = (modules as u32) * 12;
    (TOP as u32 + rows + (LEGEND + AXIS) as u32).clamp(super::DEFAULT_HEIGHT, super::MAX_SIDE)
}

#[cfg(test)]
mod tests {
    use super::round_steps;

    #[test]
    fn step_ticks_fall_on_round_numbers() {
        assert_eq!(round_steps(0, 299), [0, 50, 100, 150, 200, 250]);
        assert_eq!(round_steps(0, 119), [0, 20, 40, 60, 80, 100]);
        assert_eq!(round_steps(37, 41), [37, 38, 39, 40, 41]);
        assert_eq!(round_steps(5, 5), [5]);
        assert_eq!(
            round_steps(1_000, 1_900),
            [1_000, 1_200, 1_400, 1_600, 1_800]
        );
    }
}
