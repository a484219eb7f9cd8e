/* kernel-parity report: the all-cases table, drawn from the JSON document in #kp-data
   (reports/casetable.py describes its rows). Only the rows in view are in the DOM; filtering and
   sorting work on arrays of row indices. A row's details, and those of the failures listed under
   each group's example, are built when clicked. Also: copy buttons. Nothing here is needed to read
   the summary, the matrices, the failure groups, the coverage or the plots. */
(function () {
  "use strict";
  function esc(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }
  // Python's "%.3g" (reports/views.py fmt_num), so a number reads the same in the static and drawn parts
  function num(x) {
    if (x === null || x === undefined) return "\u2014";
    if (typeof x === "string") return x;
    if (Number.isInteger(x) && Math.abs(x) < 1e15) return String(x);
    var p = x.toExponential(2).split("e"), e = +p[1];
    if (e < -4 || e >= 3) {
      var a = Math.abs(e);
      return p[0].replace(/\.?0+$/, "") + "e" + (e < 0 ? "-" : "+") + (a < 10 ? "0" : "") + a;
    }
    return String(+x.toPrecision(3));
  }
  function dur(s) {
    if (typeof s !== "number") return "\u2014";
    if (s >= 1) return s.toFixed(2) + " s";
    if (s >= 1e-3) return (s * 1e3).toFixed(2) + " ms";
    return (s * 1e6).toFixed(1) + " \u00b5s";
  }
  function key(x) {  // sort key of a number cell: NaN and inf as the largest, missing as the smallest
    if (x === null || x === undefined) return -Infinity;
    if (typeof x === "string") return x === "nan" || x === "inf" ? Infinity : x === "-inf" ? -Infinity : parseFloat(x);
    return x;
  }
  function cid(id) {  // an id that wraps only after "/" or ","
    return '<span class="cid">' + (id.match(/[^\/,]*[\/,]|[^\/,]+$/g) || [id]).map(function (p) {
      return "<span>" + esc(p) + "</span>";
    }).join("<wbr>") + "</span>";
  }

  document.addEventListener("click", function (ev) {
    var b = ev.target.closest && ev.target.closest("button.copy");
    if (!b) return;
    ev.stopPropagation();
    navigator.clipboard.writeText(b.dataset.copy).then(function () { b.textContent = "copied"; });
  }, true);
  Array.prototype.forEach.call(document.querySelectorAll("button.copy, .jsonly"), function (b) { b.hidden = false; });

  var node = document.getElementById("kp-data");
  if (!node) return;
  var D = JSON.parse(node.textContent), S = D.s, V = D.verdicts, rows = D.rows, cols = D.cols;
  var FAILING = {fail: 1, error: 1, crash: 1, timeout: 1, flaky: 1, xpass: 1};
  var devices = D.kind === "devices" ? D.devices : null;
  var n = rows.length;
  var ids = new Array(n), hay = new Array(n);
  for (var i = 0; i < n; i++) {
    var r = rows[i];
    ids[i] = r[0].map(function (k) { return S[k]; }).join("/");
    var h = [ids[i]], cases = devices ? r[r.length - 1] : [r[r.length - 1]];
    for (var c = 1; c < cols.length; c++) if (cols[c].type === "verdict" && r[c] >= 0) h.push(V[r[c]]);
    cases.forEach(function (p) { if (p) { if (p[0] >= 0) h.push(S[p[0]]); if (p[2] >= 0) h.push(S[p[2]]); } });
    hay[i] = h.join(" ").toLowerCase();
  }

  // -- details of one case --------------------------------------------------------------------------
  var OUT_METRICS = ["numel", "max_abs", "max_rel", "rmse", "nmse", "cos_diff", "max_ulp", "mismatch"];
  function repro(cmd) {
    return '<div class="repro"><code>' + esc(cmd) + '</code><button class="copy" data-copy="' + esc(cmd) + '">copy</button></div>';
  }
  function caseHtml(i, p, verdict, normErr, device) {
    var v = V[verdict], x = p[5] || {}, h = [];
    h.push('<div class="case cdet c-' + v + '"><div><span class="vb v-' + v + '">' + v + "</span>");
    if (p[0] >= 0) h.push(' <span class="muted">' + esc(S[p[0]]) + "</span>");
    if (p[1] >= 0) h.push(' <span class="muted">(' + esc(S[p[1]]) + " limits)</span>");
    if (device) h.push(" <b>" + esc(device) + "</b>");
    h.push(' <span class="id">' + cid(ids[i]) + '</span> <span class="muted">norm_err=' + num(normErr) + "</span></div>");
    h.push('<div class="reason">' + esc(p[2] >= 0 ? S[p[2]] : (v === "pass" ? "within every limit" : "no reason given")) + "</div>");
    if (x.d) h.push('<div class="reason"><b>diagnosis:</b> ' + esc(x.d) + "</div>");
    if (x.k) h.push('<div class="reason"><b>known failure:</b> ' + esc(x.k) + "</div>");
    if (p[4].length) {
      h.push('<div class="scroll"><table class="grid"><thead><tr><th>output</th><th>dtype</th><th>shape</th>');
      OUT_METRICS.forEach(function (m) { h.push("<th>" + m + "</th>"); });
      h.push("<th>limits</th></tr></thead><tbody>");
      p[4].forEach(function (o) {
        h.push('<tr><td class="mono">' + esc(S[o[0]]) + (o[12] ? ' <span class="muted">exact</span>' : "") + "</td><td>" +
               esc(o[1] >= 0 ? S[o[1]] : "\u2014") + '</td><td class="mono">' + esc(o[2] >= 0 ? S[o[2]] : "\u2014") + "</td>");
        for (var k = 3; k < 11; k++) h.push('<td class="n">' + num(o[k]) + "</td>");
        h.push('<td class="mono">' + esc(o[11] >= 0 ? S[o[11]] : "") + "</td></tr>");
      });
      h.push("</tbody></table></div>");
    }
    if (p[3] >= 0) {
      h.push("<div>" + S[p[3]].split(" ").map(function (kv) {
        var q = kv.split(":"), cls = q[1] === "pass" ? "ok" : q[1] === "fail" ? "bad" : "na";
        return '<span class="ly ' + cls + '" title="' + esc(kv) + '">' + esc(q[0]) + "</span>";
      }).join("") + "</div>");
    }
    if (x.c) h.push('<p class="mono">recheck: ' + esc(x.c) + "</p>");
    if (x.s) {
      h.push('<div class="shrunk"><b>smallest case failing the same way</b> (<code>parity shrink</code>): <span class="id">' +
             cid(String(x.s[0] || "")) + '</span> <span class="muted">' + esc(x.s[1] || "") + (x.s[2] ? " (" + esc(x.s[2]) + ")" : "") +
             ": " + esc(x.s[3] || "") + "</span>" + (x.s[4] ? repro(x.s[4]) : "") + "</div>");
    }
    if (x.m) h.push("<pre>" + esc(x.m) + "</pre>");
    else if (FAILING[v] && !p[5]) h.push('<p class="muted">This failure\'s message is not in the page (only the ' + D.detail_limit +
                                         " most severe failing cases carry theirs): the results JSON has it, and the repro replays it.</p>");
    h.push(repro(x.r || "parity repro " + ids[i]));
    h.push("</div>");
    return h.join("");
  }
  function rowDetail(i) {
    var r = rows[i];
    if (!devices) return caseHtml(i, r[7], r[1], r[2], null);
    var ps = r[r.length - 1], h = [];
    devices.forEach(function (d, k) {
      h.push(ps[k] ? caseHtml(i, ps[k], r[1 + 2 * k], r[2 + 2 * k], d)
                   : '<div class="case cdet c-skip"><b>' + esc(d) + '</b> <span class="muted">did not run this case</span></div>');
    });
    return h.join("");
  }

  // failures listed under each group's example: a click shows (or hides) the case's details
  Array.prototype.forEach.call(document.querySelectorAll("ol.olist > li[data-row]"), function (li) { li.classList.add("js"); });
  document.addEventListener("click", function (ev) {
    var li = ev.target.closest && ev.target.closest("ol.olist > li[data-row]");
    if (!li || ev.target.closest(".cdet") || String(window.getSelection()).length) return;
    var open = li.querySelector(".cdet-wrap");
    if (open) { li.removeChild(open); return; }
    var div = document.createElement("div");
    div.className = "cdet-wrap";
    div.innerHTML = rowDetail(+li.dataset.row);
    li.appendChild(div);
  });

  // -- the table ------------------------------------------------------------------------------------
  var scroller = document.getElementById("tscroll"), tbody = document.getElementById("tbody");
  var thead = document.getElementById("thead"), colgroup = document.getElementById("cols");
  var filter = document.getElementById("filter"), vfilter = document.getElementById("vfilter");
  var counter = document.getElementById("count"), detail = document.getElementById("detail");
  if (!scroller) return;
  var byId = ids.slice().sort(), idRank = new Map();  // the native string sort, once: ids sort as numbers
  for (i = 0; i < n; i++) idRank.set(byId[i], i);
  var keys = cols.map(function (col, c) {
    var k = new Float64Array(n);
    if (col.type === "id") {
      for (var j = 0; j < n; j++) k[j] = idRank.get(ids[j]);
      return k;
    }
    for (var i = 0; i < n; i++) {
      var x = rows[i][c];
      k[i] = col.type === "verdict" ? (x < 0 ? 99 : x) : key(x);
    }
    return k;
  });
  var order = new Array(n), view = [], sortCol = -1, sortDesc = false, selected = -1, rowH = 22;
  for (i = 0; i < n; i++) order[i] = i;
  var widths = {id: "", verdict: devices ? "76px" : "84px", num: "100px", dur: "92px", ratio: "80px"};
  colgroup.innerHTML = cols.map(function (col) { return '<col style="width:' + (widths[col.type] || "auto") + '">'; }).join("");
  thead.innerHTML = cols.map(function (col, c) {
    return '<th data-c="' + c + '"' + (col.help ? ' title="' + esc(col.help) + '"' : "") + ">" + esc(col.name) + "</th>";
  }).join("");

  function cell(i, c) {
    var col = cols[c], x = rows[i][c];
    if (col.type === "id") return '<td class="id" title="' + esc(ids[i]) + '">' + esc(ids[i]) + "</td>";
    if (col.type === "verdict") return x < 0 ? '<td class="muted">not run</td>' : '<td><span class="vb v-' + V[x] + '">' + V[x] + "</span></td>";
    if (col.type === "dur") return '<td class="n">' + dur(x) + "</td>";
    if (col.type === "ratio") return '<td class="n' + (typeof x === "string" || x >= 4 ? " flag" : "") + '">' + num(x) + "</td>";
    return '<td class="n">' + num(x) + "</td>";
  }
  function draw() {
    var top = scroller.scrollTop, h = scroller.clientHeight || 600;
    var first = Math.max(0, Math.floor(top / rowH) - 5), last = Math.min(view.length, Math.ceil((top + h) / rowH) + 5);
    var out = ['<tr style="height:' + first * rowH + 'px"></tr>'];
    for (var k = first; k < last; k++) {
      var i = view[k], tds = "";
      for (var c = 0; c < cols.length; c++) tds += cell(i, c);
      out.push('<tr class="r' + (i === selected ? " sel" : "") + '" data-i="' + i + '">' + tds + "</tr>");
    }
    out.push('<tr style="height:' + (view.length - last) * rowH + 'px"></tr>');
    tbody.innerHTML = out.join("");
  }
  function measure() {
    var tr = tbody.querySelector("tr.r");
    if (tr && tr.offsetHeight) rowH = tr.offsetHeight;
  }
  function refilter() {
    var terms = filter.value.toLowerCase().split(/\s+/).filter(Boolean), want = vfilter.value;
    var vcols = [];
    cols.forEach(function (col, c) { if (col.type === "verdict") vcols.push(c); });
    view = [];
    for (var k = 0; k < n; k++) {
      var i = order[k], ok = true;
      if (want) {
        ok = false;
        for (var q = 0; q < vcols.length && !ok; q++) {
          var v = rows[i][vcols[q]];
          ok = v >= 0 && (want === "failing" ? !!FAILING[V[v]] : V[v] === want);
        }
      }
      for (var t = 0; ok && t < terms.length; t++) ok = hay[i].indexOf(terms[t]) >= 0;
      if (ok) view.push(i);
    }
    counter.textContent = view.length === n ? n + " cases" : view.length + " of " + n + " cases";
    scroller.scrollTop = 0;
    draw();
  }
  // order by sign * key, ties by row index (the first order), without a JS comparator: each row's rank
  // (its key's first position in the natively sorted keys) times n plus its index is one exact float,
  // and Float64Array's own sort orders those; 3-10x faster than order.sort(compare) on 20,000 rows
  function sortedOrder(k, sign) {
    var v = new Float64Array(n), comp = new Float64Array(n), i;
    for (i = 0; i < n; i++) v[i] = sign * k[i] || 0;  // -0 as 0: the native sort puts -0 first
    var u = v.slice().sort();
    for (i = 0; i < n; i++) {
      var lo = 0, hi = n, x = v[i];
      while (lo < hi) { var mid = (lo + hi) >> 1; if (u[mid] < x) lo = mid + 1; else hi = mid; }
      comp[i] = lo * n + i;
    }
    comp.sort();
    for (i = 0; i < n; i++) order[i] = comp[i] % n;
  }
  function sortBy(c, desc) {
    sortCol = c; sortDesc = desc;
    sortedOrder(keys[c], desc ? -1 : 1);
    Array.prototype.forEach.call(thead.children, function (th, j) {
      th.className = j === c ? (desc ? "sorted-desc" : "sorted-asc") : "";
    });
    refilter();
  }
  thead.addEventListener("click", function (ev) {
    var th = ev.target.closest("th");
    if (!th) return;
    var c = +th.dataset.c, type = cols[c].type;
    // first click: the worst first (largest numbers, most severe verdicts), then the other way
    var desc = sortCol === c ? !sortDesc : (type === "num" || type === "ratio" || type === "dur");
    sortBy(c, desc);
  });
  tbody.addEventListener("click", function (ev) {
    var tr = ev.target.closest("tr.r");
    if (!tr) return;
    selected = +tr.dataset.i;
    detail.innerHTML = rowDetail(selected);
    draw();
  });
  var pending = false;
  scroller.addEventListener("scroll", function () {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; draw(); });
  });
  filter.addEventListener("input", refilter);
  vfilter.addEventListener("change", refilter);
  document.getElementById("tools").hidden = false;
  scroller.hidden = false;
  refilter();
  measure();
  draw();
  // a hook for tests and the curious: what the table shows now
  window.kpTable = {
    rows: n,
    shown: function () { return view.length; },
    visibleIds: function () {
      return Array.prototype.map.call(tbody.querySelectorAll("tr.r"), function (tr) { return ids[+tr.dataset.i]; });
    },
    idsInOrder: function (k) { return view.slice(0, k).map(function (i) { return ids[i]; }); }
  };
})();
