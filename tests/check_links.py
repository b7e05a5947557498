#!/usr/bin/env python3
"""Check the manual's links and every reference to a repository file.

Usage: check_links.py REPO_ROOT [--allow-missing PATH]... [--links-only]

Links. Every Markdown link or image `[text](target)` (and every reference definition
`[label]: target`) of README.md, docs/*.md and benchmarks/*.md, outside fenced code blocks and inline
code, is checked, except http(s):// and mailto: targets: the target file must exist, and a `#anchor`
must match a heading of that file by GitHub's slug rules (lowercase; punctuation removed except hyphens
and spaces; spaces to hyphens; a repeated slug gets -1, -2, ...).

References. Every file of the repository (git's tracked and untracked-but-not-ignored files; without
git, a walk that skips build*/, results/, deps/, .git/ and __pycache__/) is searched for tokens that
name a repository file:
  - in *.cpp, *.hpp, *.cpp.in and *.py: their comments and string literals;
  - in *.md, *.sh, *.toml, *.yml, CMakeLists.txt, Makefile and extensionless shell scripts: the whole
    text (a shell or CMake word, a TOML value and Markdown prose are all text a reader follows).
A reference is either a path that starts with a top-level entry of the repository (TOP_LEVEL below:
`core/`, `docs/`, `.github/`, ...) and whose last component has a file extension
(`core/hooks.hpp`, `plan/tape.{hpp,cpp}`, `suites/catalog/*.toml`), optionally with a `#anchor` after
a `.md`; or the bare name of a Markdown file (`README.md`). URLs are blanked out first, and a path
that continues another one (`../core/x.hpp`, or another project's `torch/csrc/...`,
`megatron/core/...`) is not a reference (a Markdown link to a file is checked as a link). A path must
exist relative to the
repository root or to the referring file's folder (a glob must match something; a `.md#anchor` must
name a heading there); a bare `.md` name must exist at the root, in docs/, in benchmarks/ or beside
the referring file. A component named by a metavariable (PLACEHOLDERS: `suites/catalog/NAME.toml`)
matches any name. GENERATED and GENERATED_PREFIXES list the few names that the build, a test or a
run makes, which never exist in a checkout, each with the reason.

`--allow-missing PATH` (relative to REPO_ROOT, repeatable) lets that one file be absent, as a link
target or a reference. `--links-only` checks the links alone. Prints `file:line: broken link target
(why)` per broken link and `file:line: reference` per broken reference and exits 1 if any; else
prints the counts and exits 0. Standard library only.
"""
import argparse
import bisect
import os
import pathlib
import posixpath
import re
import subprocess
import sys
import urllib.parse

FENCE = re.compile(r'^ {0,3}(`{3,}|~{3,})')
ATX = re.compile(r'^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$')
SETEXT = re.compile(r'^ {0,3}(=+|-+)[ \t]*$')
INLINE_CODE = re.compile(r'(`+)(?:(?!\1).)+?\1')
# [text](target) or ![alt](target), with an optional title; the target may be <...>.
LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)'
                  r'(?:\s+(?:"[^"]*"|\'[^\']*\'|\([^)]*\)))?\s*\)')
REF_DEF = re.compile(r'^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)')
HTML_ANCHOR = re.compile(r'<a\s[^>]*\b(?:name|id)\s*=\s*["\']([^"\']+)["\']', re.IGNORECASE)
SKIP_SCHEMES = ('http://', 'https://', 'mailto:')


def markdown_lines(text):
    """Yield (line number, line) for the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                continue
            yield number, line
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not line.strip()[len(match.group(1)):].strip():
            fence = None


def heading_text_to_slug(text):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', text)  # links and images: their text
    text = re.sub(r'<[^>]+>', '', text)                     # inline HTML
    text = text.strip().lower()
    text = re.sub(r'[^\w\- ]', '', text)                    # punctuation, but not - _ or spaces
    return text.replace(' ', '-')


def anchors_of(path, cache={}):
    if path not in cache:
        slugs, seen = set(), {}
        previous = None  # the previous line, when it could be a setext heading's text
        for _, line in markdown_lines(path.read_text(encoding='utf-8')):
            text = None
            atx = ATX.match(line)
            if atx:
                text = atx.group(2) or ''
                previous = None
            elif SETEXT.match(line) and previous is not None:
                text, previous = previous, None
            else:
                stripped = line.strip()
                is_text = stripped and not re.match(r'([-*+>|]|\d+[.)])(\s|$)', stripped) \
                    and not line.startswith('    ')
                previous = stripped if is_text else None
            for anchor in HTML_ANCHOR.findall(line):
                slugs.add(anchor)
            if text is None:
                continue
            slug = heading_text_to_slug(text)
            if slug in seen:
                seen[slug] += 1
                slug = f'{slug}-{seen[slug]}'
            else:
                seen[slug] = 0
            slugs.add(slug)
        cache[path] = slugs
    return cache[path]


def links_of(text):
    """Yield (line number, target) for every link outside code."""
    for number, line in markdown_lines(text):
        ref = REF_DEF.match(line)
        if ref:
            yield number, ref.group(1)
            continue
        for match in LINK.finditer(INLINE_CODE.sub('', line)):
            yield number, match.group(1)


def check(root, allow_missing):
    files = [root / 'README.md'] + sorted((root / 'docs').glob('*.md')) + sorted((root / 'benchmarks').glob('*.md'))
    problems, count = [], 0
    for source in files:
        if not source.is_file():
            problems.append(f'{source.relative_to(root)}:0: {source.name} (file missing)')
            continue
        for number, target in links_of(source.read_text(encoding='utf-8')):
            if target.startswith('<') and target.endswith('>'):
                target = target[1:-1]
            if target.lower().startswith(SKIP_SCHEMES):
                continue
            count += 1
            where = f'{source.relative_to(root)}:{number}'
            path_part, _, anchor = target.partition('#')
            path_part = urllib.parse.unquote(path_part)
            anchor = urllib.parse.unquote(anchor)
            if re.match(r'^[a-zA-Z][a-zA-Z0-9+.-]*:', path_part) or path_part.startswith('/'):
                problems.append(f'{where}: broken link {target} (not a relative path)')
                continue
            resolved = (source.parent / path_part).resolve() if path_part else source.resolve()
            try:
                relative = resolved.relative_to(root.resolve()).as_posix()
            except ValueError:
                problems.append(f'{where}: broken link {target} (outside the repository)')
                continue
            if not resolved.exists():
                if relative not in allow_missing:
                    problems.append(f'{where}: broken link {target} (no file {relative})')
                continue
            if not anchor:
                continue
            if resolved.is_dir():
                problems.append(f'{where}: broken link {target} (an anchor on a directory)')
            elif resolved.suffix.lower() == '.md':
                if anchor not in anchors_of(resolved):
                    problems.append(f'{where}: broken link {target} (no heading #{anchor} in {relative})')
            elif not re.fullmatch(r'L\d+(-L\d+)?', anchor):
                problems.append(f'{where}: broken link {target} (anchor #{anchor} on a file that is not Markdown)')
    return files, count, problems


# ---- references to repository files, in every text of the repository ----

# The repository's top-level entries a path reference starts with (one folder per concern, and the CI).
TOP_LEVEL = ('core', 'suites', 'probes', 'reports', 'plan', 'runners', 'tests', 'docs', 'bench', 'scripts',
             'cmake', 'benchmarks', '.ci', '.github')
# Names that never exist in a checkout because the build, a test or a run makes them, each with the
# reason; a reference equal to one, or ending in '/' + one, is not checked.
GENERATED = {
    'generated/test_paths.hpp': "tests/CMakeLists.txt writes it into the build tree at configure time "
                                "(file(GENERATE)): the tests' paths to the source and build folders",
    'generated/build_info.cpp': "CMakeLists.txt's configure_file() makes it in the build tree from "
                                "cmake/build_info.cpp.in (the version and commit)",
    'report.md': 'every run writes it into its results folder beside report.json; the manual names it',
    'ab.md': '`trainscope ab` writes it into its output folder (the pull-request comment)',
    'step-summary.md': "tests/test_compare.cpp's scratch file standing in for $GITHUB_STEP_SUMMARY",
}
# Folders that exist only in the build tree, under the same relative path, with the reason.
GENERATED_PREFIXES = {
    'tests/scratch/': "ctest's scratch folder, <build>/tests/scratch (kScratchDir in tests/CMakeLists.txt), "
                      "where the tests leave reports and screenshots for people",
}
# Metavariables a path may hold in place of a name (suites/catalog/NAME.toml): each matches any name.
PLACEHOLDERS = {'NAME', 'DIR', 'FILE', 'PATH', 'CELL', 'SUITE', 'MODEL'}
# Files whose whole text is searched (the others: see text_kind).
WHOLE_TEXT_SUFFIXES = {'.md', '.sh', '.toml', '.yml', '.yaml'}
WHOLE_TEXT_NAMES = {'CMakeLists.txt', 'Makefile'}
SKIP_DIRS = {'.git', 'results', 'deps', '__pycache__'}

URL = re.compile(r'\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s<>"\'`)\]]*')
_TOP = '|'.join(re.escape(t) for t in TOP_LEVEL)
# A path: a top-level entry, then path characters, brace alternatives {a,b} and glob characters; not
# the continuation of a longer path or word.
PATH_REF = re.compile(r'(?<![\w./~$@-])((?:' + _TOP + r')/(?:[\w.+\-/*?]|\{[\w.+\-,/]*\})*)(#[\w-]+)?')
BARE_MD = re.compile(r'(?<![\w./~$@-])([A-Za-z0-9_][\w-]*\.md)(?![\w/-])(#[\w-]+)?')
EXTENSION = re.compile(r'\.[A-Za-z][A-Za-z0-9]*$')


def repository_files(root):
    """The repository's files: git's tracked and untracked-but-not-ignored ones, else a walk."""
    try:
        out = subprocess.run(['git', '-C', str(root), 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                             capture_output=True, check=True).stdout.decode('utf-8', 'replace')
        names = sorted({n for n in out.split('\0') if n})
        return [root / n for n in names if (root / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for folder, dirs, files in os.walk(root):
        at_top = pathlib.Path(folder) == root
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not (at_top and d.startswith('build')))
        found += [pathlib.Path(folder) / f for f in sorted(files)]
    return found


def text_kind(path):
    """'c', 'python' (comments and strings) or 'text' (all of it) for a file that is searched, else None."""
    if path.name in WHOLE_TEXT_NAMES or path.suffix in WHOLE_TEXT_SUFFIXES:
        return 'text'
    if path.name.endswith('.cpp.in') or path.suffix in ('.cpp', '.hpp'):
        return 'c'
    if path.suffix == '.py':
        return 'python'
    if not path.suffix:
        try:
            with open(path, 'rb') as f:
                first = f.readline(200)
        except OSError:
            return None
        if first.startswith(b'#!') and (b'sh' in first.split(b'/')[-1] or b'bash' in first):
            return 'text'
    return None


def c_segments(text):
    """Yield (offset, text) of every comment and string literal of C or C++ source."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            end = text.find('\n', i)
            end = n if end < 0 else end
            yield i, text[i:end]
            i = end
        elif text.startswith('/*', i):
            end = text.find('*/', i + 2)
            end = n if end < 0 else end + 2
            yield i, text[i:end]
            i = end
        elif c == '"':
            raw = re.search(r'(?<![\w])(?:u8|[uUL])?R$', text[max(0, i - 4):i])
            if raw:
                delim = re.match(r'[^()\\\s]{0,16}\(', text[i + 1:])
                if delim:
                    close = ')' + delim.group(0)[:-1] + '"'
                    end = text.find(close, i)
                    end = n if end < 0 else end + len(close)
                    yield i, text[i:end]
                    i = end
                    continue
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == '\\' else 1
            yield i, text[i:j + 1]
            i = j + 1
        elif c == "'":
            if i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] not in "'\n":
                j += 2 if text[j] == '\\' else 1
            i = j + 1
        else:
            i += 1


PY_STRING_START = re.compile(r'(?<![\w])([rRbBuUfF]{0,2})(\'\'\'|"""|\'|")')


def python_segments(text):
    """Yield (offset, text) of every comment and string literal of Python source."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '#':
            end = text.find('\n', i)
            end = n if end < 0 else end
            yield i, text[i:end]
            i = end
            continue
        m = PY_STRING_START.match(text, i) if c in 'rRbBuUfF\'"' else None
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == '_')):
            quote = m.group(2)
            raw = 'r' in m.group(1).lower()
            j = m.end()
            while j < n:
                if not raw and text[j] == '\\':
                    j += 2
                    continue
                if text.startswith(quote, j):
                    j += len(quote)
                    break
                if len(quote) == 1 and text[j] == '\n':
                    break
                j += 1
            yield i, text[i:j]
            i = j
            continue
        if c.isalnum() or c == '_':
            while i < n and (text[i].isalnum() or text[i] == '_'):
                i += 1
            continue
        i += 1


def expand_braces(path):
    """plan/tape.{hpp,cpp} -> [plan/tape.hpp, plan/tape.cpp] (one level, any number of groups)."""
    match = re.search(r'\{([^{}]*)\}', path)
    if not match:
        return [path]
    return [e for alt in match.group(1).split(',')
            for e in expand_braces(path[:match.start()] + alt + path[match.end():])]


def generated(reference):
    return any(reference == g or reference.endswith('/' + g) for g in GENERATED) or \
        any(reference.startswith(p) for p in GENERATED_PREFIXES)


def with_placeholders(path):
    """suites/catalog/NAME.toml -> suites/catalog/*.toml; None when the path holds no metavariable."""
    parts = path.split('/')
    changed = False
    for i, part in enumerate(parts):
        stem, dot, ext = part.partition('.')
        if stem in PLACEHOLDERS:
            parts[i] = '*' + dot + ext
            changed = True
    return '/'.join(parts) if changed else None


def path_exists(root, folder, path, anchor, allow_missing):
    """Whether a path reference resolves (root first, then the referring file's folder)."""
    candidates = [root, folder] if folder != root else [root]
    for base in candidates:
        if any(ch in path for ch in '*?'):
            pattern = posixpath.normpath((base.relative_to(root) / path).as_posix()) if base != root else path
            hits = [p for p in root.glob(pattern)]
            if hits:
                return True
            continue
        target = (base / path)
        try:
            relative = target.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            continue
        if relative in allow_missing:
            return True
        if target.exists():
            if anchor and target.suffix.lower() == '.md' and target.is_file():
                return anchor in anchors_of(target.resolve())
            return True
    return False


def bare_md_exists(root, folder, name, anchor):
    for base in (root, root / 'docs', root / 'benchmarks', folder):
        target = base / name
        if target.is_file():
            return not anchor or anchor in anchors_of(target.resolve())
    return False


def references_in(text):
    """Yield (offset, reference, path, anchor, is_bare_md) for the candidate references of a text."""
    text = URL.sub(lambda m: ' ' * len(m.group(0)), text)
    for m in PATH_REF.finditer(text):
        token = m.group(1).rstrip('.-/,')
        anchor = (m.group(2) or '')[1:] if token == m.group(1) else ''
        paths = expand_braces(token)
        if not all(EXTENSION.search(posixpath.basename(p)) for p in paths):
            continue
        yield m.start(1), token + (('#' + anchor) if anchor else ''), paths, anchor, False
    for m in BARE_MD.finditer(text):
        anchor = (m.group(2) or '')[1:]
        yield m.start(1), m.group(0), [m.group(1)], anchor, True


def check_references(root, allow_missing):
    """Every reference to a repository file that does not resolve, as `file:line: reference`."""
    problems, count, searched = [], 0, 0
    for source in repository_files(root):
        kind = text_kind(source)
        if kind is None:
            continue
        try:
            text = source.read_text(encoding='utf-8')
        except (OSError, UnicodeDecodeError):
            continue
        searched += 1
        segments = {'c': c_segments, 'python': python_segments}.get(kind, lambda t: [(0, t)])(text)
        line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == '\n']
        folder = source.parent
        relative_source = source.relative_to(root).as_posix()
        seen, found = set(), []
        for offset, segment in segments:
            for start, reference, paths, anchor, bare in references_in(segment):
                line = bisect.bisect_right(line_starts, offset + start)
                if (line, reference) in seen:
                    continue
                seen.add((line, reference))
                count += 1
                if generated(reference.split('#')[0]):
                    continue
                if bare:
                    ok = bare_md_exists(root, folder, paths[0], anchor)
                else:
                    ok = all(path_exists(root, folder, p, anchor, allow_missing)
                             or (with_placeholders(p) is not None
                                 and path_exists(root, folder, with_placeholders(p), anchor, allow_missing))
                             for p in paths)
                if not ok:
                    found.append((line, reference))
        problems += [f'{relative_source}:{line}: {reference}' for line, reference in sorted(found)]
    return searched, count, problems


def main():
    parser = argparse.ArgumentParser(
        description='Check the relative links of README.md, docs/*.md and benchmarks/*.md, and every '
                    'reference to a repository file in the repository\'s text.')
    parser.add_argument('root', type=pathlib.Path, help='the repository root')
    parser.add_argument('--allow-missing', action='append', default=[], metavar='PATH',
                        help='a link target or reference (relative to the root) that may be missing; repeatable')
    parser.add_argument('--links-only', action='store_true', help='check the Markdown links only')
    args = parser.parse_args()
    allow = {posixpath.normpath(p) for p in args.allow_missing}
    root = args.root.resolve()
    files, count, problems = check(root, allow)
    for problem in problems:
        print(problem)
    searched, references, broken = (0, 0, []) if args.links_only else check_references(root, allow)
    for problem in broken:
        print(problem)
    if problems or broken:
        print(f'{len(problems)} broken link(s) of {count} in {len(files)} file(s); '
              f'{len(broken)} broken reference(s) of {references} in {searched} file(s)', file=sys.stderr)
        return 1
    print(f'{count} relative links in {len(files)} files: all resolve')
    if not args.links_only:
        print(f'{references} references to repository files in {searched} files: all resolve')
    return 0

if __name__ == '__main__':
    sys.exit(main())
