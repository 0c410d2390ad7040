// A small renderer of line and stacked-area charts as inline SVG, for pages
// that must open anywhere without a network or a plotting library: axes with
// round tick values, units, a legend, optional x ranges shaded behind the data
// or drawn as labelled boxes in lanes under the plot (the phases of a step).
// Each chart also carries its drawn data as JSON in data-tip, for an optional
// hover read-out; the SVG itself needs no script.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace anvil::svg {

struct Axis {
  std::string unit;        // printed at the axis: "step", "ms", "MiB", "tokens/s"
  bool from_zero = false;  // quantities whose size matters (throughput, memory) start at zero
  bool whole = false;      // ticks at whole numbers only (steps)
};

struct Line {
  std::string name, color;
  std::vector<double> x, y;  // ascending x; a NaN y leaves a gap
  bool markers = false;      // a dot per point, for sparse series such as validation loss
  bool dashed = false;
  double opacity = 1.0;
};

// Areas stacked in order, the first at the bottom.
struct Stack {
  std::vector<std::string> names, colors;
  std::vector<double> x;               // ascending
  std::vector<std::vector<double>> y;  // [layer][point]
  bool steps = false;                  // hold each value until the next x (live memory between events)
};

// An x range: shaded behind the data (lane < 0), or a box in one of the lanes under the plot.
struct Band {
  double x0 = 0, x1 = 0;
  std::string label, color, tooltip;
  int lane = -1;
  std::string short_label;  // drawn when the label does not fit the box
};

// A marked point with a label, such as the peak.
struct Note {
  double x = 0, y = 0;
  std::string text;
};

struct Chart {
  std::string label;  // what the chart shows, for screen readers and the hover read-out
  double width = 580, plot_height = 170;
  Axis x, y;
  std::vector<Line> lines;
  std::optional<Stack> stack;
  std::vector<Band> bands;
  std::vector<std::string> lanes;  // names of the lanes under the plot, top first
  std::vector<Note> notes;
  std::string empty_message = "no data";
};

// <svg class="chart" ...> with viewBox = width × its computed height; scales with the page.
std::string render(const Chart& chart);

// Round tick values (1, 2 or 5 × 10^k apart) covering [lo, hi], about `target` of them.
struct Ticks {
  double step = 1;
  std::vector<double> values;
};
Ticks nice_ticks(double lo, double hi, int target, bool whole = false);

// A tick label with as many decimals as the tick spacing needs; thousands as
// "12k", very small values as "8e-4".
std::string format_tick(double value, double step);

// Text and attribute values for HTML and SVG.
std::string escape_xml(std::string_view text);

}  // namespace anvil::svg
