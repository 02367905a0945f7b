#!/usr/bin/env python3
"""Checks of scripts/eval_report.py on the fixtures in tests/eval/data/report
(v1: a real run's summary without schema_version; v2: the same run edited per
the issue-14 contract by make_report_v2_fixture.py). Run by
tests/eval/eval_report_test.cpp with Debian's /usr/bin/python3.

    eval_report_test.py html SOURCE_DIR       the report's structure and numbers
    eval_report_test.py chromium SOURCE_DIR [SCREENSHOT_DIR]
                                              renders report.html in headless Chromium: the page
                                              loads without errors and every image decodes;
                                              exit 77 (skipped) when chromium is not installed

Exit 0 = passed, 1 = failed (the failures are printed), 77 = skipped.
"""
import base64
import html.parser
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
    return cond


class Page(html.parser.HTMLParser):
    """The parts of report.html the checks need: ids, links, images, tables (as rows of cell
    texts), the text of <details class='unsolved'>, captions and <pre> blocks."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.links, self.imgs, self.tables, self.unsolved, self.pres = set(), [], [], [], [], []
        self.nav_links = []
        self._stack = []
        self._cell = None
        self._row = None
        self._unsolved = None
        self._pre = None
        self._in_nav = False
        self.text = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "nav":
            self._in_nav = True
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
            if self._in_nav:
                self.nav_links.append(a["href"])
        if tag == "img":
            self.imgs.append(a)
        if tag == "table":
            self.tables.append([])
        if tag == "tr" and self.tables:
            self._row = []
        if tag in ("td", "th"):
            self._cell = []
        if tag == "details" and "unsolved" in a.get("class", ""):
            self._unsolved = []
            self._depth = 0
        if tag == "pre":
            self._pre = []
        self._stack.append(tag)

    def handle_endtag(self, tag):
        if tag == "nav":
            self._in_nav = False
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr" and self._row is not None and self.tables:
            self.tables[-1].append(self._row)
            self._row = None
        if tag == "details" and self._unsolved is not None:
            self.unsolved.append("".join(self._unsolved))
            self._unsolved = None
        if tag == "pre" and self._pre is not None:
            self.pres.append("".join(self._pre))
            self._pre = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._unsolved is not None and self._cell is None:
            self._unsolved.append(data)
        if self._pre is not None:
            self._pre.append(data)


def wilson(k, n):
    z = 1.959963984540054
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z / d * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5)
    return max(0.0, c - h), min(1.0, c + h)


def table_with(page, header0, needle):
    """The first table whose header row starts with header0 and holds a header cell containing needle."""
    for t in page.tables:
        if t and t[0] and t[0][0] == header0 and any(needle in h for h in t[0]):
            return t
    return None


def render(src, version, work):
    run_dir = os.path.join(work, version)
    shutil.copytree(os.path.join(src, "tests", "eval", "data", "report", version), run_dir)
    r = subprocess.run(["/usr/bin/python3", os.path.join(src, "scripts", "eval_report.py"), run_dir],
                       capture_output=True, text=True, env=dict(os.environ, MPLBACKEND="Agg"))
    if not check(r.returncode == 0, f"{version}: eval_report.py failed ({r.returncode}): {r.stderr[-3000:]}"):
        return None
    return run_dir


def check_html(src):
    import matplotlib.image as mpimg

    work = tempfile.mkdtemp(prefix="posenc-report-test-")
    try:
        for version in ("v1", "v2"):
            run_dir = render(src, version, work)
            if not run_dir:
                continue
            with open(os.path.join(run_dir, "summary.json")) as f:
                summary = json.load(f)
            with open(os.path.join(run_dir, "report.html"), encoding="utf-8") as f:
                doc = f.read()
            page = Page()
            page.feed(doc)
            v = version
            # atomic write: no temporaries left next to the report
            left = [n for n in os.listdir(run_dir) if n.startswith(".report-") or n.endswith(".tmp")]
            check(not left, f"{v}: temporaries left in the run dir: {left}")
            # contents list: every section linked, every link resolves
            check(len(page.nav_links) >= 7, f"{v}: contents lists {len(page.nav_links)} entries")
            for h in page.links:
                if h.startswith("#"):
                    check(h[1:] in page.ids, f"{v}: contents link {h} has no target")
            for sec in ("s-config", "s-effective", "s-chance", "s-controls", "s-tasks", "s-ppl", "s-task-name_recall",
                        "s-task-passkey"):
                check("#" + sec in page.nav_links, f"{v}: contents has no link to {sec}")
            # run configuration as a table, with run.json's values
            cfg = table_with(page, "section", "value")
            if check(cfg is not None, f"{v}: no run-configuration table"):
                kv = {r[1]: r[2] for r in cfg[1:] if len(r) == 3}
                check(kv.get("trained_context") == "512", f"{v}: trained_context row = {kv.get('trained_context')!r}")
                check(kv.get("lengths") == "128, 256, 512", f"{v}: lengths row = {kv.get('lengths')!r}")
                check(kv.get("run_id") == summary["run_id"], f"{v}: run_id row")
                check((kv.get("family") == "rope") == (v == "v2"), f"{v}: family row = {kv.get('family')!r}")
            # the summaries are tables, not a terminal dump: the text table only inside <details>
            pres = [m.start() for m in re.finditer("<pre>", doc)]
            check(len(pres) == 1 and doc.rfind("<details>", 0, pres[0]) > doc.rfind("</details>", 0, pres[0]),
                  f"{v}: the text summary (report.txt) is shown outside one collapsed <details> ({len(pres)} <pre>)")
            eff = table_with(page, "task", "effective context")
            n_eff = 12 if v == "v1" else 18  # (2 tasks x 2 controls x 3 scalings) x metrics (v2: acc+acc_norm)
            if check(eff is not None, f"{v}: no effective-context table"):
                check(len(eff) - 1 == n_eff, f"{v}: effective-context rows {len(eff) - 1}, expected {n_eff}")
                nr = [r for r in eff[1:] if r[0] == "name_recall" and r[1] == "none" and r[3].startswith(
                    "acc_norm" if v == "v2" else "acc")]
                check(len(nr) == 3 and all(r[7] == "128" for r in nr), f"{v}: name_recall effective context {nr}")
                pk = [r for r in eff[1:] if r[0] == "passkey"]
                check(pk and all(r[7].startswith("not solvable") for r in pk), f"{v}: passkey rows {pk}")
            ch = table_with(page, "task", "chance [95% CI]")
            if check(ch is not None, f"{v}: no chance table"):
                rows = {(r[0], r[2], r[3]): r for r in ch[1:]}
                if v == "v1":
                    r = rows.get(("name_recall", "default", "acc"))
                    check(r is not None and r[4] == "0.25" and r[6] == "assumed", f"v1: chance row {r}")
                else:
                    # the measured level: 7 of 30 under acc_norm (make_report_v2_fixture.py ABSENT)
                    r = rows.get(("name_recall", "default", "acc_norm"))
                    lo, hi = wilson(7, 30)
                    want = f"{7 / 30:.2f} [{lo:.2f}, {hi:.2f}]"
                    check(r is not None and r[4] == want and r[6] == "measured" and r[8] == "yes",
                          f"v2: chance row {r}, expected {want} measured")
                    r = rows.get(("name_recall", "yarn", "acc"))
                    check(r is not None and r[4].startswith(f"{10 / 30:.2f}"), f"v2: yarn acc chance row {r}")
                r = rows.get(("passkey", "default", "first_integer"))
                check(r is not None and r[6] == "none" and r[4] == "0.00", f"{v}: passkey chance row {r}")
            # per-length accuracy with CIs, the trained context marked on the length header
            lt = [t for t in page.tables if t and t[0][:2] == ["scaling", "metric"]]
            check(len(lt) >= 2, f"{v}: {len(lt)} per-length tables")
            if lt:
                check(lt[0][0][-1] == "L=512 (T)", f"{v}: per-length header {lt[0][0]}")
                cells = [c for c in summary["cells"] if c["task"] == "name_recall" and c["control"] == "none"
                         and c["rope_scaling"] == "default" and c["length"] == 128]
                k, n = sum(c["correct"] for c in cells), sum(c["n"] for c in cells)
                lo, hi = wilson(k, n)
                want = f"{k / n:.2f} [{lo:.2f}, {hi:.2f}]"
                check(lt[0][1][2] == want, f"{v}: name_recall default L=128 {lt[0][1][2]!r}, expected {want!r}")
            # controls (shuffle) and, in v2, the absent control
            ct = table_with(page, "task", "L=128")
            if check(ct is not None, f"{v}: no controls table"):
                ctrls = {r[1] for r in ct[1:]}
                check({"none", "shuffle"} <= ctrls and (("absent" in ctrls) == (v == "v2")),
                      f"{v}: controls in the table {ctrls}")
            check(table_with(page, "task", "followed_rate") is not None, f"{v}: no paired-controls table")
            # passkey: no scaling solves it -> one collapsed line, its heatmaps inside the <details> only
            check(len(page.unsolved) == 1 and "passkey" in page.unsolved[0] and "no scaling solves it" in
                  page.unsolved[0], f"{v}: collapsed lines {page.unsolved}")
            plots = sorted(os.listdir(os.path.join(run_dir, "plots")))
            check([p for p in plots if "passkey" in p] == ["heatmaps_passkey_none.png", "heatmaps_passkey_shuffle.png"],
                  f"{v}: plots drawn for passkey: {plots}")
            m = re.search(r"<details id='s-task-passkey' class='unsolved'>(.*?)</details>", doc, re.S)
            if check(m is not None, f"{v}: no collapsed block for passkey"):
                block = m.group(1)
                check(block.count("<img ") == 2 and "alt='passkey heatmaps'" in block,
                      f"{v}: the passkey heatmaps are not inside its collapsed block")
                check(doc.count("alt='passkey heatmaps'") == 1, f"{v}: passkey heatmaps outside the collapsed block")
            for p in ("heatmaps_name_recall_none.png", "heatmaps_name_recall_shuffle.png",
                      "accuracy_name_recall_none.png", "accuracy_name_recall_shuffle.png", "ppl_by_position.png"):
                check(p in plots, f"{v}: {p} not written")
            # the chance level anchoring the colours, and where it comes from
            if v == "v1":
                check("chance 0.25 assumed = 1/K (K=4)" in doc, "v1: no 'assumed = 1/K' caption")
            else:
                # each scaling's own measured level (acc_norm: default 7 of 30, make_report_v2_fixture.py ABSENT),
                # never the scalings' samples added up (n=90 would count the same prompts three times)
                lo, hi = wilson(7, 30)
                want = f"default {7 / 30:.2f} [{lo:.2f}, {hi:.2f}] (n=30)"
                check(want in doc and "measured by the &#x27;absent&#x27; control" in doc,
                      f"v2: no per-scaling chance caption {want!r}")
                check("n=90" not in doc, "v2: a chance level pooled over scalings (n=90) in the report")
            check("chance 0 (generation task" in doc, f"{v}: no generation chance caption")
            # every image is an embedded PNG that decodes, one per plot file
            srcs = [i.get("src", "") for i in page.imgs]
            check(len(srcs) == len(plots), f"{v}: {len(srcs)} images for {len(plots)} plot files")
            for s in srcs:
                if not check(s.startswith("data:image/png;base64,"), f"{v}: image not embedded: {s[:60]}"):
                    continue
                a = mpimg.imread(io.BytesIO(base64.b64decode(s.split(",", 1)[1])), format="png")
                check(a.ndim == 3 and a.shape[0] > 100 and a.shape[1] > 100, f"{v}: image of shape {a.shape}")
            check_units(src, run_dir, summary, page, v)
            # perplexity buckets, with the bootstrap interval where the file has one (v2)
            pt = table_with(page, "context", "ppl")
            if check(pt is not None, f"{v}: no perplexity table"):
                check(len(pt) - 1 == 9, f"{v}: {len(pt) - 1} perplexity rows")
                has_ci = any("[" in c for r in pt[1:] for c in r[7:])
                check(has_ci == (v == "v2"), f"{v}: bucket intervals shown = {has_ci}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_scripts(src):
    sys.path.insert(0, os.path.join(src, "scripts"))
    import eval_report
    import plot_ppl

    return eval_report, plot_ppl


def check_units(src, run_dir, summary, page, v):
    """The helpers behind the plots and tables, on the fixture's own data."""
    er, pp = load_scripts(src)
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    R = er.Run(summary, run)
    # no difference band where a scaling's per-length counts equal default's (same correct, same n)
    m = R.primary_metric("name_recall")
    base = R.pooled("name_recall", "none", "default", m)
    for s in ("linear", "yarn"):
        pts = R.pooled("name_recall", "none", s, m)
        Ls = [L for L in pts if L in base]
        for L, (d, lo, hi) in zip(Ls, er.diff_points(pts, base, Ls)):
            if pts[L] == base[L]:
                check((d, lo, hi) == (0.0, 0.0, 0.0), f"{v}: {s} L={L} identical counts, band {(d, lo, hi)}")
            else:
                check(lo < d < hi, f"{v}: {s} L={L} counts {pts[L]} vs {base[L]}: band {(d, lo, hi)}")
    check(er.diff_points({1: (5, 20)}, {1: (5, 20)}, [1]) == [(0.0, 0.0, 0.0)] and
          er.diff_points({1: (5, 20)}, {1: (6, 20)}, [1])[0][1] < -0.2, f"{v}: diff_points on 5/20 vs 5/20, 6/20")
    # bold in the per-length table = the effective-context gate: Wilson low > the chance's upper bound
    t = er.length_table(R, "name_recall", "none")
    for row in re.findall(r"<tr>(.*?)</tr>", t)[1:]:
        tds = re.findall(r"<td>(.*?)</td>", row)
        s, metric = tds[0], tds[1]
        gate = er.chance_gate(R.chance("name_recall", s, metric))
        pts = R.pooled("name_recall", "none", s, metric)
        for L, td in zip(sorted(pts), tds[2:]):
            lo = wilson(*pts[L])[0]
            check(("class='above'" in td) == (lo > gate), f"{v}: {s} {metric} L={L} bold={td[:26]} lo={lo} gate={gate}")
    if v == "v2":
        ch = R.chance("name_recall", "default", "acc_norm")
        check(er.chance_gate(ch) == ch["ci_high"] and ch["ci_high"] > ch["accuracy"], f"v2: gate {ch}")
    check("the upper bound of the measured chance interval" in " ".join(page.text), f"{v}: no bold rule caption")
    # ppl-by-scaling: every bucket drawn within its window (a [0,256) bucket of L=128 stops at 128)
    with open(os.path.join(run_dir, "ppl.json")) as f:
        ppl = json.load(f)
    figs = []
    saved = pp.save_png_atomic
    pp.save_png_atomic = lambda fig, path, **kw: figs.append(fig)
    try:
        pp.plot_ppl_by_scaling(ppl, os.path.join(run_dir, "unused_"))
    finally:
        pp.save_png_atomic = saved
    ctxs = sorted({r["context"] for r in ppl["results"]})
    check(len(figs) == len({r["rope_scaling"] for r in ppl["results"]}), f"{v}: {len(figs)} by-scaling figures")
    for fig in figs:
        ax = fig.axes[0]
        by_colour = {}
        for ln in ax.lines:
            if len(ln.get_xdata()) == 2 and ln.get_xdata()[0] != ln.get_xdata()[1]:
                by_colour.setdefault(ln.get_color(), []).append(max(ln.get_xdata()))
        for j, L in enumerate(ctxs):
            xs = by_colour.get(pp.OKABE_ITO[j % len(pp.OKABE_ITO)].lower()) or by_colour.get(pp.OKABE_ITO[j])
            check(xs and max(xs) == L, f"{v}: window L={L} drawn to x={xs}")
    check(pp.clip_to_window([{"start": 0, "end": 256}, {"start": 256, "end": 512}], 128) == [{"start": 0, "end": 128}],
          f"{v}: clip_to_window")
    if v == "v2":
        # A bucket of one window has null bounds and a note (posenc writes no zero-width interval): the table says
        # "1 window: no interval" with the reason, and the plots draw it without a band (no crash on null).
        import copy
        one = copy.deepcopy(ppl)
        for key in ("buckets", "fine_buckets"):
            for b in one["results"][0].get(key, [])[:1]:
                b.update(windows=1, nll_ci_low=None, nll_ci_high=None,
                         nll_ci_note="one window holds all of this bucket's predictions: no interval can be estimated "
                                     "from a single window (a longer text or a shorter context gives more windows)")
        figs.clear()
        pp.save_png_atomic = lambda fig, path, **kw: figs.append(fig)
        try:
            tab, _ = er.ppl_section(one, os.path.join(run_dir, "unused"))
        finally:
            pp.save_png_atomic = saved
        check(len(figs) >= 1, f"{v}: one-window bucket: {len(figs)} figures")
        check(tab.count("(1 window: no interval)") == 1, f"{v}: one-window bucket cell: {tab.count('1 window')}")
        check("no interval can be estimated from it" in tab, f"{v}: one-window caption")
        check(tab.count("<span class='ci'>[") == sum(len(r["buckets"]) for r in one["results"]) - 1,
              f"{v}: the other buckets keep their intervals")
    # a model without RoPE: its panel is named by its family, not "default"
    R2 = er.Run(summary, dict(run, model=dict(run.get("model", {}), family="alibi")))
    check(R2.scaling_title("default") == "alibi positions", f"{v}: alibi panel title {R2.scaling_title('default')}")
    check(R.scaling_title("default") == "default", f"{v}: RoPE panel title {R.scaling_title('default')}")
    # samples per second rounded in the configuration table
    sps = (run.get("timing") or {}).get("samples_per_second")
    if sps is not None:
        cfg = table_with(page, "section", "value")
        kv = {r[1]: r[2] for r in cfg[1:] if len(r) == 3} if cfg else {}
        check(kv.get("samples_per_second") == f"{sps:.1f}", f"{v}: samples_per_second {kv.get('samples_per_second')}")


def check_bad_run_dirs(src):
    """A run dir whose plots is a file, or whose report.html is a directory, or with cells that do not fit."""
    work = tempfile.mkdtemp(prefix="posenc-report-bad-")
    try:
        for what in ("plots", "report.html"):
            d = os.path.join(work, what)
            shutil.copytree(os.path.join(src, "tests", "eval", "data", "report", "v2"), d)
            bad = os.path.join(d, what)
            if what == "plots":
                open(bad, "w").close()
            else:
                os.mkdir(bad)
            r = subprocess.run(["/usr/bin/python3", os.path.join(src, "scripts", "eval_report.py"), d],
                               capture_output=True, text=True, env=dict(os.environ, MPLBACKEND="Agg"))
            lines = r.stderr.strip().splitlines()
            check(r.returncode == 1 and len(lines) == 1 and bad in lines[0] and "Traceback" not in r.stderr,
                  f"{what}: exit {r.returncode}, stderr {r.stderr[-800:]!r}")
        # cells that do not fit the model's context: "does not fit", as the text table says
        d = os.path.join(work, "nofit")
        shutil.copytree(os.path.join(src, "tests", "eval", "data", "report", "v2"), d)
        with open(os.path.join(d, "summary.json")) as f:
            summary = json.load(f)
        for c in summary["cells"]:
            if c["task"] == "name_recall" and c["rope_scaling"] == "default" and c["length"] == 512:
                c.update(status="does not fit", n=0, correct=0, accuracy=None, ci_low=None, ci_high=None,
                         metrics={})
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump(summary, f)
        r = subprocess.run(["/usr/bin/python3", os.path.join(src, "scripts", "eval_report.py"), d],
                           capture_output=True, text=True, env=dict(os.environ, MPLBACKEND="Agg"))
        if check(r.returncode == 0, f"nofit: exit {r.returncode} {r.stderr[-1500:]}"):
            page = Page()
            with open(os.path.join(d, "report.html"), encoding="utf-8") as f:
                page.feed(f.read())
            lt = [t for t in page.tables if t and t[0][:2] == ["scaling", "metric"]]
            row = lt[0][1] if lt else []
            check(row[:2] == ["default", "acc_norm"] and row[-1] == "does not fit" and "n/a" not in row,
                  f"nofit: per-length row {row}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


CHECK_JS = """<script>
window.__posencErrors = [];
window.addEventListener('error', function (e) {
  var t = e.target;
  window.__posencErrors.push(t && t.tagName ? ('resource ' + t.tagName + ' ' + (t.alt || '')) : String(e.message));
}, true);
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var out = {images: imgs.length, errors: window.__posencErrors,
             bad: imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0 && i.naturalHeight > 0); })
                      .map(function (i) { return i.alt; }),
             sizes: imgs.map(function (i) { return [i.naturalWidth, i.naturalHeight]; }),
             title: document.title};
  var pre = document.createElement('pre');
  pre.id = 'posenc-check';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium_binary():
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None


def check_chromium(src, shots):
    chrome = chromium_binary()
    if not chrome:
        print("SKIPPED: chromium is not installed (Debian package chromium; scripts/install-deps installs it)")
        return SKIP
    work = tempfile.mkdtemp(prefix="posenc-report-chromium-")
    flags = ["--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
             "--disable-extensions", f"--user-data-dir={os.path.join(work, 'profile')}"]
    try:
        for version in ("v1", "v2"):
            run_dir = render(src, version, work)
            if not run_dir:
                continue
            with open(os.path.join(run_dir, "report.html"), encoding="utf-8") as f:
                doc = f.read()
            n_img = doc.count("<img ")
            # The page as written plus the checking script at the start of <head> (the report itself has none).
            checked = os.path.join(run_dir, "check.html")
            with open(checked, "w", encoding="utf-8") as f:
                f.write(doc.replace("<head>", "<head>" + CHECK_JS, 1))
            r = subprocess.run([chrome] + flags + ["--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000",
                                                   "--dump-dom", "file://" + checked],
                               capture_output=True, text=True, timeout=180)
            if not check(r.returncode == 0, f"{version}: chromium --dump-dom exit {r.returncode}: "
                                            f"{r.stderr[-2000:]}"):
                continue
            m = re.search(r"<pre id=\"posenc-check\">(.*?)</pre>", r.stdout, re.S)
            if not check(m is not None, f"{version}: the load handler did not run (no #posenc-check in the DOM)"):
                continue
            res = json.loads(html_unescape(m.group(1)))
            check(res["images"] == n_img and n_img >= 6, f"{version}: {res['images']} images loaded of {n_img}")
            check(not res["bad"], f"{version}: images that do not decode: {res['bad']}")
            check(not res["errors"], f"{version}: page errors: {res['errors']}")
            check(all(w > 100 and h > 100 for w, h in res["sizes"]), f"{version}: image sizes {res['sizes']}")
            console = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
            check(not console, f"{version}: console messages: {console}")
            if shots:
                os.makedirs(shots, exist_ok=True)
                png = os.path.join(shots, f"report_{version}.png")
                s = subprocess.run([chrome] + flags + ["--window-size=1400,9000", f"--screenshot={png}",
                                                       "file://" + os.path.join(run_dir, "report.html")],
                                   capture_output=True, text=True, timeout=180)
                check(s.returncode == 0 and os.path.getsize(png) > 10000, f"{version}: screenshot failed {s.stderr[-500:]}")
                print(f"screenshot: {png}")
            print(f"{version}: {res['images']} images decoded, sizes {res['sizes']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def html_unescape(s):
    import html as h

    return h.unescape(s)


def main(argv):
    if len(argv) < 2 or argv[0] not in ("html", "chromium"):
        print(__doc__)
        return 2
    src = argv[1]
    rc = 0
    if argv[0] == "html":
        check_html(src)
        check_bad_run_dirs(src)
    else:
        rc = check_chromium(src, argv[2] if len(argv) > 2 else None)
        if rc == SKIP:
            return SKIP
    for f in FAILURES:
        print("FAILED:", f)
    print(f"{len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
