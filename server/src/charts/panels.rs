//! Small multiples: panels in a grid under one title, each a line chart of its own
//! (its value axis, its name for a title) over the same steps, so that thirty series
//! read as easily as one and each keeps a scale that shows its shape.

use plotters::coord::Shift;
use plotters::prelude::*;

use super::lines::{self, draw_empty};
use super::shapes::Panels;
use super::{FONT, MAX_SIDE, MIN_SIDE, TITLE_SIZE, fit_from_the_end, plot_error};

/// A panel's height, and the narrowest a panel gets before the grid has fewer
/// columns, in pixels.
pub const PANEL_HEIGHT: u32 = 250;
const MIN_PANEL_WIDTH: u32 = 380;
/// The chart's title row.
const TITLE_PX: u32 = 40;

/// The grid of `count` panels in `width` pixels: (columns, rows). One panel takes
/// the whole width; more fill rows of as many as fit.
pub fn grid(count: usize, width: u32) -> (usize, usize) {
    let count = count.max(1);
    let columns = ((width / MIN_PANEL_WIDTH).max(1) as usize).min(count);
    (columns, count.div_ceil(columns))
}

/// The height that gives each of `count` panels its [`PANEL_HEIGHT`] at `width`.
pub fn natural_height(count: usize, width: u32) -> u32 {
    let (_, rows) = grid(count, width);
    (TITLE_PX + rows as u32 * PANEL_HEIGHT).clamp(MIN_SIDE, MAX_SIDE)
}

pub fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &Panels) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    if chart.panels.is_empty() {
        return draw_empty(root, &chart.title, chart.from, chart.to);
    }
    let (width, _) = root.dim_in_pixel();
    let title_font = TextStyle::from((FONT, TITLE_SIZE).into_font().style(FontStyle::Bold));
    let title = fit_from_the_end(root, &chart.title, &title_font, width as i32 - 24);
    root.draw(&Text::new(title, (12, 10), title_font))
        .map_err(plot_error)?;
    let (_, body) = root.split_vertically(TITLE_PX);
    let (columns, rows) = grid(chart.panels.len(), width);
    // A panel's title is a metric's name, up to 512 bytes: cut to its panel.
    let caption_font = TextStyle::from((FONT, TITLE_SIZE).into_font());
    for (panel, area) in chart.panels.iter().zip(body.split_evenly((rows, columns))) {
        let room = area.dim_in_pixel().0 as i32 - 24;
        let mut panel = panel.clone();
        panel.title = fit_from_the_end(&area, &panel.title, &caption_font, room);
        lines::draw(&area, &panel)?;
    }
    Ok(())
}
