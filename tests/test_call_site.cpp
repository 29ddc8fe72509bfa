// Call-site resolution for graph-break messages: the innermost user frame of a raw stack, with
// file:line from the line tables (tests build with -g1) and frames inside libkiln skipped.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "compiler/capture/call_site.h"

using namespace kiln::compiler::detail;

namespace {

// capture_stack() runs in libkiln, so its own frame must be skipped and this one found.
__attribute__((noinline)) std::pair<CallSite, int> where_am_i() {
  const int line = __LINE__ + 1;
  RawStack stack = capture_stack();
  return {user_call_site(stack), line};
}

}  // namespace

TEST(CallSite, FindsTheInnermostUserFrameWithFileAndLine) {
  auto [site, line] = where_am_i();
  ASSERT_TRUE(site.known()) << "function: " << site.function;
  EXPECT_TRUE(site.file.ends_with("test_call_site.cpp")) << site.file;
  EXPECT_EQ(site.line, line);
  EXPECT_NE(site.function.find("where_am_i"), std::string::npos) << site.function;
}

TEST(CallSite, FormatsAsFileColonLine) {
  auto [site, line] = where_am_i();
  std::string text = format_call_site(site);
  EXPECT_TRUE(text.ends_with("test_call_site.cpp:" + std::to_string(line))) << text;
}

TEST(CallSite, UnknownWithoutFrames) {
  CallSite site = user_call_site(RawStack{});
  EXPECT_FALSE(site.known());
  EXPECT_EQ(format_call_site(site), "<unknown>");
}
