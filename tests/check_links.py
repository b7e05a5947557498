#!/usr/bin/env python3
"""Check the relative links of the manual: README.md and docs/*.md.

Usage: check_links.py REPO_ROOT [--allow-missing PATH]...

Every Markdown link or image `[text](target)` (and every reference definition `[label]: target`)
outside fenced code blocks and inline code is checked, except http(s):// and mailto: targets:
the target file must exist, and a `#anchor` must match a heading of that file by GitHub's slug
rules (lowercase; punctuation removed except hyphens and spaces; spaces to hyphens; a repeated
slug gets -1, -2, ...). `--allow-missing PATH` (relative to REPO_ROOT, repeatable) lets that one
file be absent. Prints `file:line: broken link target (why)` per broken link and exits 1 if any;
else prints a count and exits 0. Standard library only.
"""
import argparse
import pathlib
import posixpath
import re
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
    files = [root / 'README.md'] + sorted((root / 'docs').glob('*.md'))
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


def main():
    parser = argparse.ArgumentParser(description='Check the relative links of README.md and docs/*.md.')
    parser.add_argument('root', type=pathlib.Path, help='the repository root')
    parser.add_argument('--allow-missing', action='append', default=[], metavar='PATH',
                        help='a link target (relative to the root) that may be missing; repeatable')
    args = parser.parse_args()
    allow = {posixpath.normpath(p) for p in args.allow_missing}
    files, count, problems = check(args.root, allow)
    for problem in problems:
        print(problem)
    if problems:
        print(f'{len(problems)} broken link(s) of {count} in {len(files)} file(s)', file=sys.stderr)
        return 1
    print(f'{count} relative links in {len(files)} files: all resolve')
    return 0


if __name__ == '__main__':
    sys.exit(main())
