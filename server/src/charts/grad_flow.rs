//! The gradient-flow heatmap: modules (rows, in model order, grouped) by steps
//! (columns), colour = log10 of the gradient norm (viridis). Exact zeros, "no
//! gradient: backward never reached" and NaN/Inf each have their own colour, which no
//! norm can take, so a cut graph is a solid grey band at a glance.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::colors::colormaps::{ColorMap, ViridisRGB};

use super::data::{FlowCell, GradFlow};
use super::lines::draw_empty;
use super::{
    FONT, LABEL_SIZE, NON_FINITE, NOT_REACHED, TITLE_SIZE, ZERO, plot_error, power_of_ten_label,
};

const TOP: i32 = 44;
const LEGEND: i32 = 70;
const AXIS: i32 = 36;

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
    let (width, height) = root.dim_in_pixel();
    let (width, height) = (width as i32, height as i32);
    let text = |size: u32| (FONT, size).into_font().color(&BLACK);
    root.draw(&Text::new(
        chart.title.clone(),
        (12, 10),
        (FONT, TITLE_SIZE),
    ))
    .map_err(plot_error)?;

    let label_width = (width as f64 * 0.3).clamp(110.0, 280.0) as i32;
    let x0 = label_width + 6;
    let x1 = width - 14;
    let y0 = TOP;
    let y1 = (height - LEGEND - AXIS).max(y0 + chart.modules.len() as i32);
    let row_height = (y1 - y0) as f64 / chart.modules.len() as f64;
    let column_width = (x1 - x0) as f64 / columns as f64;

    let logs: Vec<f64> = chart
        .cells
        .iter()
        .flatten()
        .filter_map(|c| match c {
            FlowCell::Norm(v) if *v > 0.0 => Some(v.log10()),
            _ => None,
        })
        .collect();
    let (mut lo, mut hi) = logs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(*v), hi.max(*v))
        });
    if !lo.is_finite() {
        (lo, hi) = (-1.0, 0.0);
    }
    if hi - lo < 1e-9 {
        (lo, hi) = (lo - 0.5, hi + 0.5);
    }
    let colour = |cell: FlowCell| -> Option<RGBColor> {
        match cell {
            FlowCell::Absent => None,
            FlowCell::NotReached => Some(NOT_REACHED),
            FlowCell::Zero => Some(ZERO),
            FlowCell::NonFinite => Some(NON_FINITE),
            FlowCell::Norm(v) => {
                Some(ViridisRGB.get_color_normalized(v.log10() as f32, lo as f32, hi as f32))
            }
        }
    };

    for (r, row) in chart.cells.iter().enumerate() {
        let top = y0 + (r as f64 * row_height) as i32;
        let bottom = (y0 + ((r + 1) as f64 * row_height).ceil() as i32).max(top + 1);
        for (c, cell) in row.iter().enumerate() {
            if let Some(fill) = colour(*cell) {
                let left = x0 + (c as f64 * column_width) as i32;
                let right = (x0 + ((c + 1) as f64 * column_width).ceil() as i32).max(left + 1);
                root.draw(&Rectangle::new(
                    [(left, top), (right, bottom)],
                    fill.filled(),
                ))
                .map_err(plot_error)?;
            }
        }
    }
    root.draw(&Rectangle::new(
        [(x0, y0), (x1, y1)],
        RGBColor(120, 120, 120).stroke_width(1),
    ))
    .map_err(plot_error)?;

    // Row labels when rows are tall enough to read; group names and separators always.
    let label_size = (row_height - 1.0).clamp(0.0, 12.0) as u32;
    let mut group_start = 0;
    for r in 0..=chart.modules.len() {
        let boundary =
            r == chart.modules.len() || (r > 0 && chart.modules[r].1 != chart.modules[r - 1].1);
        if boundary {
            let (_, group) = &chart.modules[group_start];
            let top = y0 + (group_start as f64 * row_height) as i32;
            let bottom = y0 + (r as f64 * row_height) as i32;
            root.draw(&PathElement::new(
                vec![(4, top), (x1, top)],
                BLACK.stroke_width(1),
            ))
            .map_err(plot_error)?;
            let middle = (top + bottom) / 2 - LABEL_SIZE as i32 / 2;
            let at = if label_size >= 7 { top + 1 } else { middle };
            root.draw(&Text::new(
                format!("[{group}]"),
                (6, at),
                (FONT, LABEL_SIZE).into_font().style(FontStyle::Bold),
            ))
            .map_err(plot_error)?;
            group_start = r;
        }
    }
    if label_size >= 7 {
        let max_chars = ((label_width - 70) as f64 / (label_size as f64 * 0.55)) as usize;
        for (r, (module, group)) in chart.modules.iter().enumerate() {
            let short = module.strip_prefix(&format!("{group}.")).unwrap_or(module);
            let short = if short.len() > max_chars.max(8) {
                format!("…{}", &short[short.len() - max_chars.max(8) + 1..])
            } else {
                short.to_owned()
            };
            let top = y0 + (r as f64 * row_height) as i32;
            root.draw(&Text::new(short, (64, top), text(label_size)))
                .map_err(plot_error)?;
        }
    }

    // The step axis.
    let span = chart.to.saturating_sub(chart.from).max(1);
    for i in 0..=4u64 {
        let step = chart.from + span * i / 4;
        let x = x0 + ((x1 - x0) as f64 * i as f64 / 4.0) as i32;
        root.draw(&PathElement::new(
            vec![(x, y1), (x, y1 + 5)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_error)?;
        root.draw(&Text::new(
            step.to_string(),
            (x - 10, y1 + 8),
            text(LABEL_SIZE),
        ))
        .map_err(plot_error)?;
    }
    root.draw(&Text::new(
        "step".to_owned(),
        ((x0 + x1) / 2 - 12, y1 + 22),
        text(LABEL_SIZE),
    ))
    .map_err(plot_error)?;

    // The legend: the colour scale, then the special states.
    let legend_top = height - LEGEND + 10;
    let bar_left = 12;
    let bar_width = 180;
    for i in 0..bar_width {
        let v = lo + (hi - lo) * i as f64 / (bar_width - 1) as f64;
        let fill: RGBColor = ViridisRGB.get_color_normalized(v as f32, lo as f32, hi as f32);
        root.draw(&Rectangle::new(
            [
                (bar_left + i, legend_top),
                (bar_left + i + 1, legend_top + 14),
            ],
            fill.filled(),
        ))
        .map_err(plot_error)?;
    }
    root.draw(&Text::new(
        power_of_ten_label(lo),
        (bar_left, legend_top + 18),
        text(LABEL_SIZE - 1),
    ))
    .map_err(plot_error)?;
    root.draw(&Text::new(
        power_of_ten_label(hi),
        (bar_left + bar_width - 30, legend_top + 18),
        text(LABEL_SIZE - 1),
    ))
    .map_err(plot_error)?;
    root.draw(&Text::new(
        "gradient norm (log)".to_owned(),
        (bar_left + 40, legend_top + 34),
        text(LABEL_SIZE - 1),
    ))
    .map_err(plot_error)?;
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
            text(LABEL_SIZE - 1),
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
