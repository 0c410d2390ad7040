#include "anvil/obs/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

namespace anvil::svg {

namespace {

constexpr double kFontWidth = 6.2;  // average advance of an 11 px sans-serif character, for layout
constexpr double kLaneHeight = 15, kLaneGap = 2;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string num(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f", v);
  return s;
}

// One command of an SVG path ("M x y" or "L x y").
void path_to(std::string& d, char command, double x, double y) {
  d += command;
  d += num(x);
  d += ' ';
  d += num(y);
}

// Compact numbers for the hover data: 5 significant digits is more than a reader can see.
std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char s[32];
  std::snprintf(s, sizeof s, "%.5g", v);
  return s;
}

std::string json_string(const std::string& s) { return nlohmann::json(s).dump(); }

double text_width(std::string_view s, double font_px = 11) {
  return static_cast<double>(s.size()) * kFontWidth * font_px / 11;
}

struct Extent {
  double lo = kInf, hi = -kInf;
  void add(double v) {
    if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

// The indices of the points to draw when there are more than two per pixel
// column: each column's lowest and highest point (lines), so spikes survive.
std::vector<size_t> thin_line(const std::vector<double>& x, const std::vector<double>& y, double x0, double x1,
                              double columns) {
  std::vector<size_t> keep;
  if (static_cast<double>(x.size()) <= 2 * columns) {
    for (size_t i = 0; i < x.size(); ++i) keep.push_back(i);
    return keep;
  }
  long column = -1;
  size_t lo = 0, hi = 0;
  bool open = false;
  auto flush = [&] {
    if (!open) return;
    keep.push_back(std::min(lo, hi));
    if (lo != hi) keep.push_back(std::max(lo, hi));
    open = false;
  };
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(y[i])) {  // a gap stays a gap
      flush();
      keep.push_back(i);
      continue;
    }
    const long c = std::lround((x[i] - x0) / (x1 - x0) * columns);
    if (!open || c != column) {
      flush();
      column = c, lo = hi = i, open = true;
    }
    if (y[i] < y[lo]) lo = i;
    if (y[i] > y[hi]) hi = i;
  }
  flush();
  return keep;
}

// For stacks, the point with the highest total per pixel column, so the peak survives.
std::vector<size_t> thin_stack(const Stack& s, double x0, double x1, double columns) {
  std::vector<size_t> keep;
  const size_t n = s.x.size();
  auto total = [&](size_t i) {
    double t = 0;
    for (const auto& layer : s.y) t += layer[i];
    return t;
  };
  if (static_cast<double>(n) <= 2 * columns) {
    for (size_t i = 0; i < n; ++i) keep.push_back(i);
    return keep;
  }
  long column = std::numeric_limits<long>::min();
  for (size_t i = 0; i < n; ++i) {
    const long c = std::lround((s.x[i] - x0) / (x1 - x0) * columns);
    if (c != column) {
      keep.push_back(i);
      column = c;
    } else if (total(i) > total(keep.back())) {
      keep.back() = i;
    }
  }
  if (keep.back() != n - 1) keep.push_back(n - 1);  // where the last value holds to
  return keep;
}

struct LegendItem {
  std::string name, color;
  bool area, markers, dashed;
  double opacity;
};

}  // namespace

std::string escape_xml(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

Ticks nice_ticks(double lo, double hi, int target, bool whole) {
  Ticks t;
  const double span = hi - lo;
  if (!(span > 0) || !std::isfinite(span)) {
    t.values.push_back(lo);
    return t;
  }
  const double raw = span / std::max(1, target);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / magnitude;
  // d3's thresholds: the step whose tick count is nearest to the target on a log scale.
  t.step = (r >= std::sqrt(50.0) ? 10 : r >= std::sqrt(10.0) ? 5 : r >= std::sqrt(2.0) ? 2 : 1) * magnitude;
  if (whole) t.step = std::max(1.0, std::round(t.step));
  const double eps = t.step * 1e-9;
  for (double v = std::ceil((lo - eps) / t.step) * t.step; v <= hi + eps; v += t.step)
    t.values.push_back(std::abs(v) < eps ? 0.0 : v);
  return t;
}

std::string format_tick(double value, double step) {
  if (value == 0) return "0";
  char s[32];
  const double a = std::abs(value);
  if (step < 1e-3) {  // learning rates: 8e-4 reads better than 0.0008
    const int exponent = static_cast<int>(std::floor(std::log10(a) + 1e-9));
    const int decimals = std::clamp(exponent - static_cast<int>(std::floor(std::log10(step) + 1e-9)), 0, 3);
    std::snprintf(s, sizeof s, "%.*fe%d", decimals, value / std::pow(10.0, exponent), exponent);
    return s;
  }
  const char* suffix = "";
  double scale = 1;
  if (a >= 1e9 && step >= 1e8)
    suffix = "G", scale = 1e9;
  else if (a >= 1e6 && step >= 1e5)
    suffix = "M", scale = 1e6;
  else if (a >= 1e4 && step >= 1e3)
    suffix = "k", scale = 1e3;
  const int decimals = std::clamp(-static_cast<int>(std::floor(std::log10(step / scale) + 1e-9)), 0, 6);
  std::snprintf(s, sizeof s, "%.*f%s", decimals, value / scale, suffix);
  return s;
}

std::string render(const Chart& c) {
  // Extent of everything that will be drawn.
  Extent xs, ys;
  for (const Line& l : c.lines)
    for (size_t i = 0; i < l.x.size(); ++i)
      if (std::isfinite(l.y[i])) xs.add(l.x[i]), ys.add(l.y[i]);
  std::vector<double> stack_top;
  if (c.stack && !c.stack->x.empty()) {
    stack_top.assign(c.stack->x.size(), 0.0);
    for (const auto& layer : c.stack->y)
      for (size_t i = 0; i < layer.size(); ++i) stack_top[i] += layer[i];
    for (size_t i = 0; i < stack_top.size(); ++i) xs.add(c.stack->x[i]), ys.add(stack_top[i]);
  }
  const bool has_data = !ys.empty();
  for (const Band& b : c.bands) xs.add(b.x0), xs.add(b.x1);
  for (const Note& n : c.notes) xs.add(n.x), ys.add(n.y);
  if (xs.empty()) xs.add(0), xs.add(1);
  if (ys.empty()) ys.add(0), ys.add(1);
  if (c.y.from_zero) ys.add(0);
  if (xs.hi == xs.lo) xs.lo -= 1, xs.hi += 1;
  if (ys.hi == ys.lo) {
    const double pad = ys.hi == 0 ? 1 : std::abs(ys.hi) * 0.1;
    ys.lo -= pad, ys.hi += pad;
  }
  // The y domain extends to round ticks; the x domain is the data's, ticks inside it.
  const Ticks yt0 = nice_ticks(ys.lo, ys.hi, 5);
  const double y0 = std::floor(ys.lo / yt0.step + 1e-9) * yt0.step, y1 = std::ceil(ys.hi / yt0.step - 1e-9) * yt0.step;
  const Ticks yt = nice_ticks(y0, y1, 5);
  const double x0 = xs.lo, x1 = xs.hi;

  // Layout: the left margin fits the widest tick label or lane name.
  double left_text = 0;
  for (const double v : yt.values) left_text = std::max(left_text, text_width(format_tick(v, yt.step)));
  for (const auto& lane : c.lanes) left_text = std::max(left_text, text_width(lane, 10));
  const double left = std::max(36.0, left_text + 12), right = 14;
  const double plot_w = c.width - left - right;
  const Ticks xt = nice_ticks(x0, x1, std::max(2, static_cast<int>(plot_w / 80)), c.x.whole);

  std::vector<LegendItem> legend;
  if (c.stack)
    for (size_t i = 0; i < c.stack->names.size(); ++i)
      legend.push_back({c.stack->names[i], c.stack->colors[i], true, false, false, 1.0});
  for (const Line& l : c.lines)
    if (!l.name.empty()) legend.push_back({l.name, l.color, false, l.markers, l.dashed, l.opacity});
  // Legend rows, filled from the right so the y unit keeps the top-left corner.
  const double legend_room = c.width - right - text_width(c.y.unit) - 24;
  std::vector<std::vector<size_t>> rows(1);
  double row_w = 0;
  auto item_w = [&](const LegendItem& it) { return 22 + text_width(it.name) + 12; };
  for (size_t i = 0; i < legend.size(); ++i) {
    if (row_w + item_w(legend[i]) > legend_room && !rows.back().empty()) rows.emplace_back(), row_w = 0;
    rows.back().push_back(i);
    row_w += item_w(legend[i]);
  }
  const double top = 12 + 16 * static_cast<double>(rows.size());
  const double plot_h = c.plot_height;
  const double lanes_h = c.lanes.empty() ? 0 : 6 + static_cast<double>(c.lanes.size()) * (kLaneHeight + kLaneGap);
  const double axis_y = top + plot_h;
  const double height = axis_y + lanes_h + 34;

  auto sx = [&](double x) { return left + (x - x0) / (x1 - x0) * plot_w; };
  auto sy = [&](double y) { return top + plot_h - (y - y0) / (y1 - y0) * plot_h; };

  std::string tip = "{\"xu\":" + json_string(c.x.unit) + ",\"yu\":" + json_string(c.y.unit) +
                    ",\"x0\":" + json_number(x0) + ",\"x1\":" + json_number(x1) + ",\"l\":" + num(left) +
                    ",\"r\":" + num(left + plot_w) + ",\"stack\":" + (c.stack ? "true" : "false") + ",\"s\":[";
  bool first_series = true;
  auto add_tip = [&](const std::string& name, const std::string& color, const std::vector<double>& x,
                     const std::vector<double>& y, const std::vector<size_t>& idx) {
    tip += first_series ? "" : ",";
    first_series = false;
    tip += "{\"n\":" + json_string(name) + ",\"c\":" + json_string(color) + ",\"x\":[";
    for (size_t k = 0; k < idx.size(); ++k) (k ? tip += ',' : tip) += json_number(x[idx[k]]);
    tip += "],\"y\":[";
    for (size_t k = 0; k < idx.size(); ++k) (k ? tip += ',' : tip) += json_number(y[idx[k]]);
    tip += "]}";
  };

  std::string body;
  // Grid and y tick labels.
  for (const double v : yt.values) {
    const double py = sy(v);
    body += "<line class=\"grid\" x1=\"" + num(left) + "\" x2=\"" + num(left + plot_w) + "\" y1=\"" + num(py) +
            "\" y2=\"" + num(py) + "\"/>";
    body += "<text class=\"tick\" x=\"" + num(left - 6) + "\" y=\"" + num(py + 3.5) + "\" text-anchor=\"end\">" +
            escape_xml(format_tick(v, yt.step)) + "</text>";
  }
  // Shaded x ranges behind the data.
  for (const Band& b : c.bands) {
    if (b.lane >= 0) continue;
    body += "<rect class=\"shade\" x=\"" + num(sx(b.x0)) + "\" y=\"" + num(top) + "\" width=\"" +
            num(std::max(0.5, sx(b.x1) - sx(b.x0))) + "\" height=\"" + num(plot_h) + "\" fill=\"" + b.color +
            "\"><title>" + escape_xml(b.tooltip.empty() ? b.label : b.tooltip) + "</title></rect>";
  }
  // Stacked areas: each layer's outline along its top, back along its bottom.
  if (c.stack && !c.stack->x.empty()) {
    const Stack& s = *c.stack;
    const std::vector<size_t> idx = thin_stack(s, x0, x1, plot_w);
    std::vector<double> below(idx.size(), 0.0);
    for (size_t layer = 0; layer < s.y.size(); ++layer) {
      std::vector<std::pair<double, double>> upper, lower;
      for (size_t k = 0; k < idx.size(); ++k) {
        const double xa = s.x[idx[k]];
        const double lo = below[k], hi = below[k] + s.y[layer][idx[k]];
        upper.emplace_back(xa, hi), lower.emplace_back(xa, lo);
        if (s.steps && k + 1 < idx.size()) {  // hold until the next sample
          upper.emplace_back(s.x[idx[k + 1]], hi), lower.emplace_back(s.x[idx[k + 1]], lo);
        }
        below[k] = hi;
      }
      std::string d;
      for (size_t k = 0; k < upper.size(); ++k) path_to(d, k ? 'L' : 'M', sx(upper[k].first), sy(upper[k].second));
      for (size_t k = lower.size(); k-- > 0;) path_to(d, 'L', sx(lower[k].first), sy(lower[k].second));
      d += "Z";
      body += "<path class=\"series area\" d=\"" + d + "\" fill=\"" + s.colors[layer] + "\" stroke=\"" +
              s.colors[layer] + "\"><title>" + escape_xml(s.names[layer]) + "</title></path>";
      add_tip(s.names[layer], s.colors[layer], s.x, s.y[layer], idx);
    }
  }
  // Lines, broken at missing values.
  for (const Line& l : c.lines) {
    const std::vector<size_t> idx = thin_line(l.x, l.y, x0, x1, plot_w);
    std::string d, dots;
    bool pen_down = false;
    for (const size_t i : idx) {
      if (!std::isfinite(l.y[i])) {
        pen_down = false;
        continue;
      }
      path_to(d, pen_down ? 'L' : 'M', sx(l.x[i]), sy(l.y[i]));
      pen_down = true;
      if (l.markers)
        dots +=
            "<circle cx=\"" + num(sx(l.x[i])) + "\" cy=\"" + num(sy(l.y[i])) + "\" r=\"3\" fill=\"" + l.color + "\"/>";
    }
    if (d.empty()) continue;
    std::string style = "stroke=\"" + l.color + "\"";
    if (l.dashed) style += " stroke-dasharray=\"5 3\"";
    if (l.opacity < 1) style += " stroke-opacity=\"" + json_number(l.opacity) + "\"";
    body +=
        "<path class=\"series line\" d=\"" + d + "\" " + style + "><title>" + escape_xml(l.name) + "</title></path>";
    body += dots;
    add_tip(l.name, l.color, l.x, l.y, idx);
  }
  for (const Note& n : c.notes) {
    const double px = sx(n.x), py = sy(n.y);
    const bool flip = px > left + plot_w * 0.7;
    body += "<circle class=\"note\" cx=\"" + num(px) + "\" cy=\"" + num(py) + "\" r=\"3.5\"/>";
    body += "<text class=\"note\" x=\"" + num(px + (flip ? -7 : 7)) + "\" y=\"" + num(std::max(top + 10, py + 4)) +
            "\" text-anchor=\"" + (flip ? "end" : "start") + "\">" + escape_xml(n.text) + "</text>";
  }
  if (!has_data)
    body += "<text class=\"empty\" x=\"" + num(left + plot_w / 2) + "\" y=\"" + num(top + plot_h / 2) +
            "\" text-anchor=\"middle\">" + escape_xml(c.empty_message) + "</text>";

  // Axes, x ticks (under the lanes, which share the x scale) and units.
  body += "<line class=\"axis\" x1=\"" + num(left) + "\" x2=\"" + num(left) + "\" y1=\"" + num(top) + "\" y2=\"" +
          num(axis_y) + "\"/>";
  body += "<line class=\"axis\" x1=\"" + num(left) + "\" x2=\"" + num(left + plot_w) + "\" y1=\"" + num(axis_y) +
          "\" y2=\"" + num(axis_y) + "\"/>";
  const double tick_y = axis_y + lanes_h;
  for (const double v : xt.values) {
    const double px = sx(v);
    body += "<line class=\"axis\" x1=\"" + num(px) + "\" x2=\"" + num(px) + "\" y1=\"" + num(tick_y) + "\" y2=\"" +
            num(tick_y + 4) + "\"/>";
    body += "<text class=\"tick\" x=\"" + num(px) + "\" y=\"" + num(tick_y + 15) + "\" text-anchor=\"middle\">" +
            escape_xml(format_tick(v, xt.step)) + "</text>";
  }
  body += "<text class=\"unit\" x=\"" + num(left + plot_w) + "\" y=\"" + num(tick_y + 29) + "\" text-anchor=\"end\">" +
          escape_xml(c.x.unit) + "</text>";
  body += "<text class=\"unit\" x=\"4\" y=\"" + num(top - 11) + "\">" + escape_xml(c.y.unit) + "</text>";

  // Lanes: one row of boxes each, labelled where the label fits.
  for (size_t lane = 0; lane < c.lanes.size(); ++lane) {
    const double ly = axis_y + 6 + static_cast<double>(lane) * (kLaneHeight + kLaneGap);
    body += "<text class=\"lane\" x=\"" + num(left - 6) + "\" y=\"" + num(ly + 11) + "\" text-anchor=\"end\">" +
            escape_xml(c.lanes[lane]) + "</text>";
    for (const Band& b : c.bands) {
      if (b.lane != static_cast<int>(lane)) continue;
      const double bx = sx(b.x0), bw = std::max(0.8, sx(b.x1) - sx(b.x0));
      body += "<g class=\"band\"><title>" + escape_xml(b.tooltip.empty() ? b.label : b.tooltip) + "</title><rect x=\"" +
              num(bx) + "\" y=\"" + num(ly) + "\" width=\"" + num(bw) + "\" height=\"" + num(kLaneHeight) +
              "\" fill=\"" + b.color + "\"/>";
      const std::string& label = text_width(b.label, 10) + 6 < bw ? b.label : b.short_label;
      if (!label.empty() && text_width(label, 10) + 6 < bw)
        body += "<text x=\"" + num(bx + bw / 2) + "\" y=\"" + num(ly + 11) + "\" text-anchor=\"middle\">" +
                escape_xml(label) + "</text>";
      body += "</g>";
    }
  }

  // Legend, right-aligned rows.
  for (size_t r = 0; r < rows.size(); ++r) {
    double w = 0;
    for (const size_t i : rows[r]) w += item_w(legend[i]);
    double lx = c.width - right - w + 12;
    const double ly = 14 + 16 * static_cast<double>(r);
    for (const size_t i : rows[r]) {
      const LegendItem& it = legend[i];
      if (it.area)
        body += "<rect x=\"" + num(lx) + "\" y=\"" + num(ly - 8) + "\" width=\"16\" height=\"10\" rx=\"2\" fill=\"" +
                it.color + "\"/>";
      else
        body +=
            "<line class=\"key\" x1=\"" + num(lx) + "\" x2=\"" + num(lx + 16) + "\" y1=\"" + num(ly - 3) + "\" y2=\"" +
            num(ly - 3) + "\" stroke=\"" + it.color + "\"" + (it.dashed ? " stroke-dasharray=\"5 3\"" : "") +
            (it.opacity < 1 ? " stroke-opacity=\"" + json_number(it.opacity) + "\"" : "") + "/>" +
            (it.markers
                 ? "<circle cx=\"" + num(lx + 8) + "\" cy=\"" + num(ly - 3) + "\" r=\"3\" fill=\"" + it.color + "\"/>"
                 : "");
      body += "<text class=\"key\" x=\"" + num(lx + 22) + "\" y=\"" + num(ly) + "\">" + escape_xml(it.name) + "</text>";
      lx += item_w(it);
    }
  }
  // A hover rule, hidden until the page's script moves it.
  body += "<line class=\"hover\" x1=\"0\" x2=\"0\" y1=\"" + num(top) + "\" y2=\"" + num(axis_y + lanes_h) +
          "\" visibility=\"hidden\"/>";
  tip += "]}";

  return "<svg class=\"chart\" viewBox=\"0 0 " + num(c.width) + " " + num(height) + "\" role=\"img\" aria-label=\"" +
         escape_xml(c.label) + "\" data-tip=\"" + escape_xml(tip) + "\">" + body + "</svg>";
}

}  // namespace anvil::svg
