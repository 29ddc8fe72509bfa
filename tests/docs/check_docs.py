#!/usr/bin/env python3
"""Compiles every ```cpp block of README.md and docs/*.md, so that a doc example that stops
compiling fails the test suite (CTest: DocsCodeBlocksCompile).

Rules, for whoever writes the docs:

- Only blocks tagged ```cpp are checked; compiler output, logs and tables go in untagged blocks.
- A block containing `int main(` is a complete program: it is compiled as written (nothing is
  added: it must include what it uses), linked against libkiln and run in an empty temporary
  working directory, with KILN_CACHE_DIR set to a private kernel cache made for this run. It must
  exit with 0.
- Every other block is a fragment. Fragments see `#include <kiln/kiln.h>`, `#include <iostream>`
  and `using namespace kiln;`, and each is compiled (not run) as the body of a function of its
  own. All fragments go into one translation unit, which is linked (not run) against libkiln.
- `#include` lines are moved to the top of the generated file, wherever they are in a block.
- A fragment that uses names defined elsewhere (x, model, opt, ...) gets them from an HTML
  comment right before the block, invisible when the page is rendered:
      <!-- doc-test context: Tensor x = randn({10, 10}), y = randn({10, 10}); -->
  The context is code placed just before the block, in the same scope; it may span lines.
- A fragment that defines functions or classes at namespace scope is marked
      <!-- doc-test: top-level -->
  and is placed at namespace scope instead, in a namespace of its own.
- Compiler errors name the markdown file and line (the generated code carries #line directives).

Usage (CTest passes the build's values):
    check_docs.py --cxx c++ --include include --library build/libkiln.so [--define NAME=VALUE]
                  [--keep DIR] [FILE.md ...]
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)```\s*(\S*)\s*$")
DIRECTIVE = re.compile(r"<!--\s*doc-test(?P<kind>\s+context:|:)(?P<body>.*?)-->", re.S)
INCLUDE = re.compile(r"^\s*#\s*include\b")
FRAGMENT_PRELUDE = ["#include <kiln/kiln.h>", "#include <iostream>"]
PROGRAM_TIMEOUT_S = 300


@dataclass
class Block:
    path: str  # relative to ROOT, as errors show it
    line: int  # 1-based line of the first code line (after the fence)
    code: list  # lines, dedented to the fence's indentation
    context: list = field(default_factory=list)  # (line, code) from doc-test context comments
    top_level: bool = False

    @property
    def is_program(self):
        return any("int main(" in line for line in self.code)

    @property
    def where(self):
        return f"{self.path}:{self.line - 1}"  # the fence line, where a reader finds the block

    @property
    def namespace(self):
        return "doc_" + re.sub(r"\W", "_", self.path) + f"_{self.line - 1}"


class DocError(Exception):
    pass


def parse(path):
    """The ```cpp blocks of one markdown file, with their doc-test comments."""
    rel = os.path.relpath(path, ROOT)
    lines = Path(path).read_text().split("\n")
    blocks, used_directives = [], set()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.group(1), opening.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise DocError(f"{rel}:{i + 1}: a code block that is never closed")
        if lang == "cpp":
            code = [l[len(indent):] if l.startswith(indent) else l.lstrip() for l in lines[i + 1:end]]
            block = Block(rel, i + 2, code)
            for start, text in directives_before(lines, i):
                used_directives.add(start)
                apply_directive(block, start, text)
            if block.is_program and (block.context or block.top_level):
                raise DocError(f"{block.where}: a complete program (int main) takes no doc-test comment")
            blocks.append(block)
        i = end + 1
    # A doc-test comment that no cpp block follows is a mistake (a moved block, a typo'd fence).
    for n, line in enumerate(lines):
        if line.lstrip().startswith("<!-- doc-test") and n not in used_directives:
            raise DocError(f"{rel}:{n + 1}: this doc-test comment is not directly before a ```cpp block")
    return blocks


def directives_before(lines, fence):
    """The doc-test comments ending right above line `fence` (blank lines allowed), top first."""
    found, n = [], fence - 1
    while n >= 0:
        if not lines[n].strip():
            n -= 1
            continue
        if not lines[n].rstrip().endswith("-->"):
            break
        start = n
        while start >= 0 and "<!--" not in lines[start]:
            start -= 1
        text = "\n".join(lines[start:n + 1]).strip()
        if start < 0 or not text.startswith("<!-- doc-test"):
            break
        found.append((start, text))
        n = start - 1
    return reversed(found)


def apply_directive(block, start, text):
    m = DIRECTIVE.fullmatch(text)
    where = f"{block.path}:{start + 1}"
    if not m:
        raise DocError(f"{where}: cannot read this doc-test comment; write "
                       "'<!-- doc-test context: CODE -->' or '<!-- doc-test: top-level -->'")
    if m.group("kind").strip() == "context:":
        body = m.group("body")
        first_line = start + 1 + body[:len(body) - len(body.lstrip())].count("\n")
        block.context.append((first_line, body.strip()))
    elif m.group("body").strip() == "top-level":
        block.top_level = True
    else:
        raise DocError(f"{where}: unknown doc-test directive '{m.group('body').strip()}'; "
                       "the known ones are 'context: CODE' and 'top-level'")


def line_directive(path, line):
    return f'#line {line} "{path}"'


def split_includes(block):
    """The block's #include lines, and its code with those lines left blank (keeps line numbers)."""
    includes, body = [], []
    for offset, text in enumerate(block.code):
        if INCLUDE.match(text):
            includes.append((block.line + offset, text.strip()))
            body.append("")
        else:
            body.append(text)
    return includes, body


def hoisted(includes, seen):
    out = []
    for (path, line), text in includes:
        if text not in seen:
            seen.add(text)
            out += [line_directive(path, line), text]
    return out


def fragments_source(blocks):
    seen, head, parts = set(FRAGMENT_PRELUDE), list(FRAGMENT_PRELUDE), []
    for block in blocks:
        includes, body = split_includes(block)
        head += hoisted([((block.path, line), text) for line, text in includes], seen)
        parts.append(f"namespace {block.namespace} {{")
        if not block.top_level:
            parts.append("void block() {")
        for line, context in block.context:
            parts += [line_directive(block.path, line), context]
        parts += [line_directive(block.path, block.line)] + body
        if not block.top_level:
            parts.append("}")
        parts.append(f"}}  // namespace {block.namespace}")
    head = ["// Generated by tests/docs/check_docs.py: every doc fragment."] + head
    head += [f'#line {len(head) + 2} "fragments.cpp"', "using namespace kiln;", ""]
    return "\n".join(head + parts +
                     ["int main() { return 0; }  // never run: linking checks the symbols exist", ""])


def program_source(block):
    includes, body = split_includes(block)
    head = hoisted([((block.path, line), text) for line, text in includes], set())
    return "\n".join(head + [line_directive(block.path, block.line)] + body + [""])


def run(cmd, **kwargs):
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **kwargs)


def report(title, output, blocks):
    """Prints a failure, naming each block whose lines the compiler output mentions."""
    print(f"FAILED: {title}")
    print(output.rstrip())
    mentioned = {(path, int(line)) for path, line in re.findall(r"^([^\s:]+\.md):(\d+):", output, re.M)}
    for block in blocks:
        first = min([block.line] + [line for line, _ in block.context])
        if any(path == block.path and first <= line <= block.line + len(block.code)
               for path, line in mentioned):
            print(f"  the ```cpp block at {block.where} does not compile")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cxx", default=os.environ.get("CXX", "c++"))
    parser.add_argument("--include", default=str(ROOT / "include"), help="Kiln's include directory")
    parser.add_argument("--library", default=str(ROOT / "build" / "libkiln.so"), help="the built libkiln")
    parser.add_argument("--define", action="append", default=[],
                        help="NAME[=VALUE] (the library's public definitions); ';'-separated lists allowed")
    parser.add_argument("--keep", help="write the generated sources and binaries here and keep them")
    parser.add_argument("files", nargs="*", help="markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args()

    files = args.files or [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    try:
        blocks = [b for f in files for b in parse(f)]
    except DocError as e:
        print(f"FAILED: {e}")
        return 1
    fragments = [b for b in blocks if not b.is_program]
    programs = [b for b in blocks if b.is_program]
    library = Path(args.library).resolve()
    defines = [f"-D{d}" for ds in args.define for d in ds.split(";") if d]
    # -O0 -w: these are compile checks, not builds to keep; warnings belong to the library's own code.
    cxx = [args.cxx, "-std=c++20", "-O0", "-w", "-pthread", f"-I{args.include}"] + defines
    link = [str(library), f"-Wl,-rpath,{library.parent}"]

    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kiln_doc_test_", dir=args.keep))  # mode 0700
    failures = 0
    try:
        source = work / "fragments.cpp"
        source.write_text(fragments_source(fragments))
        result = run(cxx + [str(source), "-o", str(work / "fragments")] + link)
        if result.returncode:
            report(f"{len(fragments)} fragments (one translation unit, {source.name})", result.stdout, fragments)
            failures += 1
        else:
            print(f"ok: {len(fragments)} fragments compile")

        cache = work / "kernel_cache"
        cache.mkdir(mode=0o700)
        for block in programs:
            name = block.namespace
            source = work / f"{name}.cpp"
            source.write_text(program_source(block))
            result = run(cxx + [str(source), "-o", str(work / name)] + link)
            if result.returncode:
                report(f"the program at {block.where}", result.stdout, [block])
                failures += 1
                continue
            cwd = work / f"{name}.cwd"  # an empty working directory for the files it writes
            cwd.mkdir()
            env = dict(os.environ, KILN_CACHE_DIR=str(cache))
            try:
                result = run([str(work / name)], cwd=cwd, env=env, timeout=PROGRAM_TIMEOUT_S)
                code = result.returncode
                status = (f"signal {signal.Signals(-code).name}" if code < 0 else
                          f"exit status {code}" if code else None)
            except subprocess.TimeoutExpired as e:
                result, status = e, f"no exit after {PROGRAM_TIMEOUT_S} s"
            if status:
                output = result.stdout or ""
                output = output if isinstance(output, str) else output.decode(errors="replace")
                print(f"FAILED: the program at {block.where} ended with {status}; its output:")
                print(output.rstrip()[-4000:] + "\n")
                failures += 1
            else:
                print(f"ok: the program at {block.where} compiles and runs")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    if args.keep:
        print(f"generated sources and binaries: {work}")
    if failures:
        print(f"{failures} failure(s); `check_docs.py --keep DIR` keeps the generated sources")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
