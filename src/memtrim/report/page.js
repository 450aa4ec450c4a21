// memtrim HTML report: switch the timeline between roles and lines, and list what was alive at the
// moment clicked. Reads its data from the page's JSON block; writes text with textContent only, so
// nothing from the trace is ever parsed as HTML.
(function () {
  "use strict";
  var errors = [];
  window.addEventListener("error", function (e) { errors.push(String(e.message)); });
  var source = document.getElementById("memtrim-data");
  if (!source) { return; }
  var data = JSON.parse(source.textContent);
  var units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

  function formatBytes(n) {
    var sign = n < 0 ? "-" : "";
    var value = Math.abs(n);
    for (var i = 0; i < units.length; i++) {
      if (value < 1024 || i === units.length - 1) {
        if (i === 0) { return sign + Math.floor(value) + " B"; }
        return sign + (value < 100 ? Number(value.toPrecision(3)).toString() : Math.round(value).toString()) +
          " " + units[i];
      }
      value /= 1024;
    }
    return sign + value + " B";
  }

  function cell(row, value, cls) {
    var td = document.createElement("td");
    td.textContent = value;
    if (cls) { td.className = cls; }
    row.appendChild(td);
    return td;
  }

  // -- by role / by line ------------------------------------------------------------------------
  var buttons = document.querySelectorAll("[data-show-mode]");
  function show(mode) {
    document.querySelectorAll("[data-mode]").forEach(function (el) {
      el.style.display = el.getAttribute("data-mode") === mode ? "" : "none";
    });
    buttons.forEach(function (b) {
      b.setAttribute("aria-pressed", b.getAttribute("data-show-mode") === mode ? "true" : "false");
    });
  }
  buttons.forEach(function (b) {
    b.addEventListener("click", function () { show(b.getAttribute("data-show-mode")); });
  });
  show("role");

  // -- what was alive at a moment -----------------------------------------------------------------
  var points = data.points;
  var allocs = data.allocs;
  var listing = document.getElementById("memtrim-alive");
  var heading = document.getElementById("memtrim-alive-heading");

  function nearest(x) {
    var lo = 0, hi = points.x.length - 1;
    while (lo < hi) {
      var mid = (lo + hi) >> 1;
      if (points.x[mid] < x) { lo = mid + 1; } else { hi = mid; }
    }
    // the last point at that op: what the op left alive (and the highest within it, for the peak)
    while (lo + 1 < points.x.length && points.x[lo + 1] === points.x[lo] &&
           points.total[lo + 1] >= points.total[lo]) { lo++; }
    return lo;
  }

  function aliveAt(index) {
    var tick = points.tick[index];
    var groups = {};
    var listed = 0;
    for (var i = 0; i < allocs.bytes.length; i++) {
      if (allocs.alloc[i] <= tick && (allocs.free[i] < 0 || allocs.free[i] > tick)) {
        var key = allocs.site[i];
        var g = groups[key];
        if (!g) { g = groups[key] = {site: key, bytes: 0, count: 0, roles: {}, biggest: i}; }
        g.bytes += allocs.bytes[i];
        g.count += 1;
        var role = data.roleNames[allocs.role[i]];
        g.roles[role] = (g.roles[role] || 0) + allocs.bytes[i];
        if (allocs.bytes[i] > allocs.bytes[g.biggest]) { g.biggest = i; }
        listed += allocs.bytes[i];
      }
    }
    var list = Object.keys(groups).map(function (k) { return groups[k]; });
    list.sort(function (a, b) { return b.bytes - a.bytes; });
    return {tick: tick, groups: list, listed: listed};
  }

  function render(index) {
    if (!listing) { return; }
    var alive = aliveAt(index);
    var made = points.made[index];
    heading.textContent = "Alive after op " + points.x[index] + " (" + formatBytes(points.total[index]) +
      " above the region's start" + (index === data.peakIndex ? ", the peak" : "") + "), by source line:";
    while (listing.firstChild) { listing.removeChild(listing.firstChild); }
    var head = document.createElement("tr");
    ["bytes", "what", "largest", "line", "code"].forEach(function (h) {
      var th = document.createElement("th");
      th.textContent = h;
      head.appendChild(th);
    });
    listing.appendChild(head);
    alive.groups.slice(0, data.rows).forEach(function (g) {
      var row = document.createElement("tr");
      cell(row, formatBytes(g.bytes), "num");
      cell(row, Object.keys(g.roles).sort(function (a, b) { return g.roles[b] - g.roles[a]; })
        .map(function (r) { return r + " " + formatBytes(g.roles[r]); }).join(", "));
      var b = g.biggest;
      cell(row, data.opNames[allocs.op[b]] + " " + allocs.shape[b] + " " + allocs.dtype[b]);
      cell(row, data.sites[g.site][0], "site");
      cell(row, data.sites[g.site][1], "code");
      listing.appendChild(row);
    });
    var rest = made - alive.listed;
    if (alive.groups.length > data.rows || rest > 0) {
      var more = document.createElement("tr");
      var td = cell(more, "", "note");
      td.colSpan = 5;
      var parts = [];
      if (alive.groups.length > data.rows) { parts.push((alive.groups.length - data.rows) + " more lines"); }
      if (rest > 0) { parts.push(formatBytes(rest) + " in allocations under " + formatBytes(data.listedMin) + " not listed"); }
      td.textContent = "(" + parts.join("; ") + ")";
      listing.appendChild(more);
    }
    document.querySelectorAll("svg.memtrim-timeline").forEach(function (svg) {
      var cursor = svg.querySelector("line.cursor");
      var width = svg.viewBox.baseVal.width;
      var left = Number(svg.getAttribute("data-left"));
      var right = Number(svg.getAttribute("data-right"));
      var xmax = Number(svg.getAttribute("data-xmax"));
      var x = left + (width - left - right) * (points.x[index] / xmax);
      cursor.setAttribute("x1", x); cursor.setAttribute("x2", x);
      cursor.setAttribute("y1", svg.getAttribute("data-top"));
      cursor.setAttribute("y2", svg.getAttribute("data-bottom"));
      cursor.setAttribute("visibility", "visible");
    });
    document.body.setAttribute("data-memtrim-selected", String(index));
  }

  document.querySelectorAll("svg.memtrim-timeline").forEach(function (svg) {
    svg.style.cursor = "crosshair";
    svg.addEventListener("click", function (event) {
      var matrix = svg.getScreenCTM();
      if (!matrix) { return; }
      var p = svg.createSVGPoint();
      p.x = event.clientX; p.y = event.clientY;
      var local = p.matrixTransform(matrix.inverse());
      var width = svg.viewBox.baseVal.width;
      var left = Number(svg.getAttribute("data-left"));
      var right = Number(svg.getAttribute("data-right"));
      var xmax = Number(svg.getAttribute("data-xmax"));
      var x = (local.x - left) / (width - left - right) * xmax;
      render(nearest(Math.max(0, Math.min(xmax, x))));
    });
  });
  if (data.peakIndex !== null) { render(data.peakIndex); }
  document.body.setAttribute("data-memtrim-ready", errors.length ? "errors" : "yes");
})();
