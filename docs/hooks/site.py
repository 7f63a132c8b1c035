r"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`).

* **Pages that live outside docs/.** README.md (the home page), launch/README.md, configs/README.md,
  benchmarks/README.md and CHANGELOG.md stay where a reader of the repository finds them and are pages
  of the site as well (`IMPORTED`), read from the same files at every build.
* **Links as in the repository.** Every page's relative links are written from where its file lives
  (README.md links `docs/results.md`, docs/evaluate.md links `../benchmarks/results/x.png`). Each is
  pointed at what it names on the site: a page of docs/, an imported page, or a repository file the
  docs show (a figure, a config), which is copied into the site under `repo/`. A link to nothing stays
  as written, and `mkdocs build --strict` fails on it.
* **Records.** A Markdown file of the repository that a page links to (a results folder's README, a
  study's report) becomes a page of the site outside the nav (`REPO`), with its own links pointed as
  above, and what it links to is copied too.
* **Tables** show `\|` inside inline code as `|`, as GitHub does (`on_page_content`).
* **The configuration reference** (docs/config.md) is generated from the config dataclasses at every
  build (`qkvflow.cli.startup.reference`), in place of the `CONFIG_REFERENCE` marker, with haliax's import-time
  DeprecationWarning filtered (`HALIAX_IMPORT_WARNING`).
"""

import os
import posixpath
import re
import warnings

from mkdocs.structure.files import File, InclusionLevel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPORTED = {
    "README.md": "index.md",
    "launch/README.md": "launchers.md",
    "configs/README.md": "configs.md",
    "benchmarks/README.md": "benchmarks_reference.md",
    "CHANGELOG.md": "changelog.md",
}
"""Repository file -> its page on the site."""
REPO = "repo/"
"""Where the site keeps the other repository files that pages link to."""
CONFIG_REFERENCE = "<!-- CONFIG_REFERENCE -->"
HALIAX_IMPORT_WARNING = r"jax\.interpreters\.pxla\.thread_resources is deprecated"
"""haliax.partitioning's import of a jax name deprecated since jax 0.8.2 (haliax's to change, not ours): the
`mkdocs` command shows DeprecationWarnings, so without this filter every build logged its stack as INFO."""
LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")  # text may hold [a, b]
FENCE = re.compile(r"^\s*(```|~~~)")


def _origin(src_uri: str) -> str:
    """The repository path of a page's source."""
    for repo_path, page in IMPORTED.items():
        if page == src_uri:
            return repo_path
    if src_uri.startswith(REPO):
        return src_uri[len(REPO) :]
    return "docs/" + src_uri


def _resolve(target: str, origin: str) -> str | None:
    """The repository path a relative link of the file `origin` names; None for URLs and anchors."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return None
    path = target.split("#")[0]
    if not path:
        return None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(origin), path))
    if path.endswith("/") and os.path.exists(os.path.join(ROOT, resolved, "README.md")):
        resolved = posixpath.join(resolved, "README.md")
    return resolved


def _site_path(repo_path: str) -> str | None:
    """Where a repository file is on the site (relative to the site's root), or None."""
    if repo_path in IMPORTED:
        return IMPORTED[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    if os.path.isfile(os.path.join(ROOT, repo_path)) and not repo_path.startswith(".."):
        return REPO + repo_path
    return None


def _links(markdown: str):
    """(match) of every link outside fenced code blocks."""
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        yield line, [] if fenced else list(LINK.finditer(line))


def _repository_files_named(markdown: str, origin: str) -> set[str]:
    named = set()
    for _, matches in _links(markdown):
        for m in matches:
            repo_path = _resolve(m.group(2), origin)
            if repo_path and not repo_path.startswith("docs/") and repo_path not in IMPORTED:
                if _site_path(repo_path):
                    named.add(repo_path)
    return named


def on_files(files, config):
    """Add the imported pages, and the repository files that any page links to."""
    pages = {}
    for repo_path, page in IMPORTED.items():
        source = os.path.join(ROOT, repo_path)
        if os.path.isfile(source):
            files.append(File.generated(config, page, abs_src_path=source))
            pages[repo_path] = source
        elif repo_path == "CHANGELOG.md":  # a checkout from before the changelog
            files.append(File.generated(config, page, content="# Changelog\n\nNo CHANGELOG.md yet.\n"))
    for f in files.documentation_pages():
        if f.abs_src_path is not None:  # (the changelog stub has no file)
            pages.setdefault(_origin(f.src_uri), f.abs_src_path)
    named, unread = set(), dict(pages)
    while unread:  # a linked Markdown file is a page too: what it links to comes along
        origin, source = unread.popitem()
        with open(source, encoding="utf-8") as text:
            found = _repository_files_named(text.read(), origin) - named
        named |= found
        unread.update({p: os.path.join(ROOT, p) for p in found if p.endswith(".md")})
    for repo_path in sorted(named):
        inclusion = InclusionLevel.NOT_IN_NAV if repo_path.endswith(".md") else InclusionLevel.UNDEFINED
        source = os.path.join(ROOT, repo_path)
        files.append(File.generated(config, REPO + repo_path, abs_src_path=source, inclusion=inclusion))
    return files


def on_page_markdown(markdown, page, config, files):
    """Point each relative link at the site's copy of what it names; fill in the config reference."""
    origin, here = _origin(page.file.src_uri), posixpath.dirname(page.file.src_uri)
    out = []
    for line, matches in _links(markdown):
        for m in reversed(matches):
            repo_path = _resolve(m.group(2), origin)
            site = _site_path(repo_path) if repo_path else None
            if site is None:
                continue
            anchor = "#" + m.group(2).split("#", 1)[1] if "#" in m.group(2) else ""
            target = posixpath.relpath(site, here or ".") + anchor
            line = line[: m.start()] + m.group(1) + target + m.group(3) + line[m.end() :]
        out.append(line)
    markdown = "".join(out)
    if CONFIG_REFERENCE in markdown:
        with warnings.catch_warnings():  # the config classes import haliax, which imports a deprecated jax name
            warnings.filterwarnings("ignore", message=HALIAX_IMPORT_WARNING, category=DeprecationWarning)
            from qkvflow.cli.startup.reference import reference

            markdown = markdown.replace(CONFIG_REFERENCE, reference())
    return markdown


CELL = re.compile(r"<td>.*?</td>", re.DOTALL)
INLINE_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)


def on_page_content(html, page, config, files):
    """A pipe inside inline code in a table cell is written `\\|` in markdown (GitHub shows `|`);
    Python-Markdown keeps the backslash, so it is dropped here."""

    def cell(m):
        return INLINE_CODE.sub(lambda c: "<code>" + c.group(1).replace("\\|", "|") + "</code>", m.group(0))

    return CELL.sub(cell, html)
