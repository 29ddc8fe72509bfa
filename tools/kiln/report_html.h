// `kiln report`'s page: one self-contained HTML file (no scripts, no network) of the compile
// traces report_trace.h reads — a summary, each function's frames, breaks, recompiles and guards,
// each graph drawn by Graphviz (a table when `dot` is missing or the graph is large), its passes,
// kernels and generated code with highlighting.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "report_trace.h"

namespace kiln::cli::report {

struct HtmlOptions {
  bool graphviz = true;            // draw graphs with `dot` when one is found
  size_t max_draw_nodes = 200;     // larger graphs get their table only (dot takes long on them)
  size_t max_source_bytes = 512 << 10;  // per generated source shown; the rest is cut with a note
};

std::string render_html(const std::vector<Process>& processes, const HtmlOptions& options);

// The absolute path of a `dot` on PATH that only root or this user can change (the file and every
// directory above it), or "" when there is none. Never a program someone else could replace.
std::string trusted_dot();

// Runs `dot -Tsvg` on `source`; the <svg> element, or "" when it failed or took over `seconds`.
std::string dot_to_svg(const std::string& dot, const std::string& source, double seconds = 30);

// `s` with &, <, >, " and ' escaped for HTML text and attributes.
std::string html_escape(const std::string& s);

// Generated C++ or CUDA source as HTML with <span class=...> around keywords, types, numbers,
// strings, comments and preprocessor lines (escaped).
std::string highlight_source(const std::string& source);

}  // namespace kiln::cli::report
