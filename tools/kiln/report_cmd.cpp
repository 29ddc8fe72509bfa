// `kiln report`: reads compile traces (report_trace.h) and writes the page (report_html.h).
#include "report_cmd.h"

#include <cstdlib>
#include <fstream>
#include <iostream>

#include "kiln/error.h"
#include "report_html.h"
#include "report_trace.h"

namespace kiln::cli {

namespace {

constexpr const char* kReportUsage =
    "usage: kiln report TRACE... -o REPORT.html [--no-graphviz] [--max-draw-nodes N]\n"
    "  TRACE: a directory of compile traces (KILN_TRACE_DIR=dir) or one trace file (.jsonl).\n"
    "  Writes one self-contained HTML page: a summary, each compiled function's frames, graph\n"
    "  breaks, recompiles and guards, each graph (drawn with Graphviz's dot when installed, up to\n"
    "  --max-draw-nodes ops, default 200), its passes, kernels and generated code.\n";

}  // namespace

int run_report(const std::vector<std::string>& args) {
  std::vector<std::string> inputs;
  std::string output;
  report::HtmlOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << kReportUsage;
      return 0;
    }
    if (a == "-o" || a == "--out") {
      KILN_CHECK(i + 1 < args.size(), ValueError, a + " needs a file name.\n" + kReportUsage);
      output = args[++i];
    } else if (a == "--no-graphviz") {
      options.graphviz = false;
    } else if (a == "--max-draw-nodes") {
      KILN_CHECK(i + 1 < args.size(), ValueError, "--max-draw-nodes needs a number.\n" + std::string(kReportUsage));
      char* end = nullptr;
      const long long n = std::strtoll(args[++i].c_str(), &end, 10);
      KILN_CHECK(end && *end == '\0' && n >= 0, ValueError, "--max-draw-nodes takes a count, got '" + args[i] + "'.");
      options.max_draw_nodes = static_cast<size_t>(n);
    } else if (!a.empty() && a[0] == '-') {
      throw ValueError("unknown option '" + a + "'.\n" + kReportUsage);
    } else {
      inputs.push_back(a);
    }
  }
  KILN_CHECK(!inputs.empty() && !output.empty(), ValueError, std::string("a trace and -o are needed.\n") + kReportUsage);
  std::vector<report::Process> processes;
  for (const std::string& input : inputs)
    for (const std::string& file : report::trace_files(input)) processes.push_back(report::read_trace(file));
  const std::string html = report::render_html(processes, options);
  // Written beside the target, then renamed: a failed write never leaves half a page.
  const std::string temp = output + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    KILN_CHECK(out.good(), Error, "cannot write '" + temp + "'.");
    out << html;
    out.close();
    KILN_CHECK(out.good(), Error, "cannot write '" + temp + "'.");
  }
  KILN_CHECK(std::rename(temp.c_str(), output.c_str()) == 0, Error, "cannot rename '" + temp + "' to '" + output + "'.");
  int64_t graphs = 0, breaks = 0;
  for (const auto& p : processes) {
    graphs += static_cast<int64_t>(p.graphs.size());
    for (const auto& f : p.functions) breaks += static_cast<int64_t>(f.breaks.size());
  }
  std::cout << "kiln report: " << output << " (" << processes.size() << " trace file" << (processes.size() == 1 ? "" : "s")
            << ", " << graphs << " graph compiles, " << breaks << " graph breaks)\n";
  return 0;
}

}  // namespace kiln::cli
