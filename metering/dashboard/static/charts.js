"use strict";
// Hand-drawn SVG charts. Values are BigInts (picodollars or token counts), so the totals each
// chart states (data-total, legends) are exact; only coordinates are Numbers. Every chart
// says what it drew in data attributes: data-series, data-points and data-total.

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
  ];

  function svg(tag, attrs = {}, children = []) {
    const node = document.createElementNS(NS, tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
    for (const child of children) node.append(child);
    return node;
  }

  function text(x, y, content, attrs = {}) {
    const node = svg("text", { x, y, ...attrs });
    node.textContent = content;
    return node;
  }

  function tooltip(content) {
    const node = svg("title");
    node.textContent = content;
    return node;
  }

  function html(tag, attrs = {}, children = []) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
    for (const child of children) node.append(child);
    return node;
  }

  /** The container's width in pixels, so that text is drawn at its own size, not scaled. */
  function widthOf(container) {
    const width = Math.floor(container.getBoundingClientRect().width);
    return Math.max(width || 760, 240);
  }

  function swatch(color) {
    return svg("svg", { width: 12, height: 12, class: "swatch", "aria-hidden": "true" }, [
      svg("rect", { width: 12, height: 12, rx: 2, fill: color }),
    ]);
  }

  function legend(series, format) {
    return html(
      "ul",
      { class: "legend" },
      series.map((s) =>
        html("li", { "data-series-key": s.key }, [
          swatch(s.color),
          ` ${s.label} `,
          html("span", { class: "num" }, [format(s.total)]),
        ]),
      ),
    );
  }

  /**
   * Stacked columns: one column per bucket, one stacked segment per series.
   * opts: {name, buckets: [{key, label}], series: [{key, label, values: Map}], format, plain,
   *        empty}
   */
  function stacked(container, opts) {
    const { name, buckets, format, plain } = opts;
    const W = widthOf(container), H = 260, left = 78, right = 10, top = 12, bottom = 46;
    const series = opts.series.map((s, i) => {
      let total = 0n;
      for (const bucket of buckets) total += s.values.get(bucket.key) ?? 0n;
      return { ...s, total, color: s.color ?? PALETTE[i % PALETTE.length] };
    });
    const heights = buckets.map((b) => series.reduce((a, s) => a + (s.values.get(b.key) ?? 0n), 0n));
    const total = heights.reduce((a, h) => a + h, 0n);
    const max = heights.reduce((a, h) => (h > a ? h : a), 0n);
    const step = Money.niceStep(max, 4);
    const top_value = step * 4n;
    const plotH = H - top - bottom, plotW = W - left - right;
    const y = (v) => top + plotH - Money.ratio(v, top_value) * plotH;

    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`,
      width: W,
      height: H,
      class: "chart",
      role: "img",
      "aria-label": opts.title ?? name,
      "data-chart": name,
      "data-series": series.length,
      "data-points": buckets.length,
      "data-total": plain(total),
    });
    for (let i = 0; i <= 4; i++) {
      const value = step * BigInt(i);
      root.append(
        svg("line", { x1: left, x2: W - right, y1: y(value), y2: y(value), class: "grid" }),
        text(left - 6, y(value) + 4, format(value), { class: "axis", "text-anchor": "end" }),
      );
    }
    const slot = plotW / Math.max(buckets.length, 1);
    const barW = Math.max(2, slot * 0.7);
    const every = Math.ceil(buckets.length / Math.max(2, Math.floor(plotW / 64)));
    buckets.forEach((bucket, i) => {
      if (i % every === 0) {
        const x = left + slot * i + slot / 2;
        root.append(text(x, H - bottom + 16, bucket.label, { class: "axis", "text-anchor": "middle" }));
      }
    });
    const base = buckets.map(() => 0n);
    for (const s of series) {
      const group = svg("g", {
        "data-series-key": s.key,
        "data-total": plain(s.total),
        fill: s.color,
      });
      buckets.forEach((bucket, i) => {
        const value = s.values.get(bucket.key) ?? 0n;
        if (value === 0n) return;
        const y0 = y(base[i]), y1 = y(base[i] + value);
        base[i] += value;
        group.append(
          svg(
            "rect",
            {
              x: left + slot * i + (slot - barW) / 2,
              y: y1,
              width: barW,
              height: Math.max(1, y0 - y1),
              "data-bucket": bucket.key,
              "data-value": plain(value),
            },
            [tooltip(`${s.label} · ${bucket.title ?? bucket.label}: ${format(value)}`)],
          ),
        );
      });
      root.append(group);
    }
    if (!series.length) {
      root.append(text(left + plotW / 2, top + plotH / 2, opts.empty ?? "nothing in this range", {
        class: "empty", "text-anchor": "middle",
      }));
    }
    container.replaceChildren(root, legend(series, format));
    return root;
  }

  /** Horizontal bars, largest first. items: [{key, label, sub, value}] */
  function ranking(container, opts) {
    const { name, items, format, plain } = opts;
    const W = widthOf(container), row = 30, labelW = Math.min(300, W * 0.35), valueW = Math.min(120, W * 0.3);
    const H = Math.max(row * items.length, row) + 4;
    const max = items.reduce((a, it) => (it.value > a ? it.value : a), 0n);
    const total = items.reduce((a, it) => a + it.value, 0n);
    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`,
      width: W,
      height: H,
      class: "chart",
      role: "img",
      "aria-label": opts.title ?? name,
      "data-chart": name,
      "data-series": items.length ? 1 : 0,
      "data-points": items.length,
      "data-total": plain(total),
    });
    const barMax = W - labelW - valueW - 10;
    items.forEach((item, i) => {
      const yTop = i * row + 4;
      const width = Math.max(2, Money.ratio(item.value, max) * barMax);
      root.append(
        svg("g", { "data-key": item.key, "data-value": plain(item.value) }, [
          text(0, yTop + 17, item.label, { class: "label" }),
          svg("rect", { x: labelW, y: yTop + 4, width, height: row - 10, rx: 3, fill: PALETTE[0] }, [
            tooltip(`${item.label}${item.sub ? " · " + item.sub : ""}: ${format(item.value)}`),
          ]),
          text(W, yTop + 17, format(item.value), { class: "num", "text-anchor": "end" }),
        ]),
      );
    });
    if (!items.length) root.append(text(W / 2, 20, opts.empty ?? "nothing in this range", {
      class: "empty", "text-anchor": "middle",
    }));
    container.replaceChildren(root);
    return root;
  }

  /**
   * Budget use: one bar per budget, spent then reserved against the limit.
   * rows: [{scope, id, label, limit (BigInt|null), spent, reserved, resetsAt, interval}]
   */
  function budgets(container, opts) {
    const { rows } = opts;
    const W = widthOf(container);
    // Narrow (a phone): the name above a full-width bar, the figures below it.
    const narrow = W < 560;
    const row = narrow ? 72 : 42, labelW = narrow ? 0 : Math.min(240, W * 0.35);
    const H = Math.max(row * rows.length, row) + 4;
    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`,
      width: W,
      height: H,
      class: "chart",
      role: "img",
      "aria-label": "budget use",
      "data-chart": "budgets",
      "data-series": new Set(rows.map((r) => r.scope)).size,
      "data-points": rows.length,
      "data-total": Money.plain(rows.reduce((a, r) => a + r.spent, 0n)),
    });
    const barW = W - labelW - 10;
    const bar = narrow ? 20 : 4; // the bar's offset in its row
    rows.forEach((r, i) => {
      const yTop = i * row + 4;
      const used = r.limit === null ? null : Money.ratio(r.spent + r.reserved, r.limit);
      const level = used === null ? "none" : used >= 0.9 ? "high" : used >= 0.75 ? "mid" : "low";
      const percent = r.limit === null ? "" : Money.percent(r.spent + r.reserved, r.limit);
      const spentW = r.limit === null ? 0 : Math.min(1, Money.ratio(r.spent, r.limit)) * barW;
      const heldW = r.limit === null ? 0
        : Math.min(1 - spentW / barW, Money.ratio(r.reserved, r.limit)) * barW;
      const summary = r.limit === null
        ? `${Money.format(r.spent)} spent · no limit`
        : `${Money.format(r.spent)} of ${Money.format(r.limit)} · ${percent}`;
      const resets = r.resetsAt ? `resets ${opts.when(r.resetsAt)}` : "never resets";
      // The mark of a budget past one of its alert thresholds: a part of a line of its own
      // (the scope line beside the name, or the figures' line on a phone), never drawn over the
      // reset time.
      const mark = () => (r.passed
        ? [" · ", svg("tspan", { class: "threshold-mark" }, [document.createTextNode(`▲ past ${r.passed}%`)])]
        : []);
      const line = (x, y, parts, cls) => {
        const node = svg("text", { x, y, class: cls });
        node.append(...parts.map((p) => (typeof p === "string" ? document.createTextNode(p) : p)));
        return node;
      };
      const resetsText = () => svg("tspan", { class: "resets" }, [document.createTextNode(resets)]);
      const group = svg("g", {
        "data-scope": r.scope,
        "data-id": r.id,
        "data-spent": Money.plain(r.spent),
        "data-reserved": Money.plain(r.reserved),
        "data-limit": r.limit === null ? "" : Money.plain(r.limit),
        "data-resets-at": r.resetsAt ?? "",
        "data-threshold": r.passed ?? "",
        "data-percent": percent,
        class: `budget ${level}${r.passed ? " past-threshold" : ""}`,
      }, [
        ...(narrow
          ? [
            text(0, yTop + 13, `${r.label} · ${r.scope} · ${r.interval}`, { class: "label" }),
            line(0, yTop + 47, [summary, ...mark()], "sub"),
            line(0, yTop + 60, [resetsText()], "sub"),
          ]
          : [
            text(0, yTop + 15, r.label, { class: "label" }),
            line(0, yTop + 32, [`${r.scope} · ${r.interval}`, ...mark()], "sub"),
            line(labelW, yTop + 33, [`${summary} · `, resetsText()], "sub"),
          ]),
        svg("rect", { x: labelW, y: yTop + bar, width: barW, height: 14, rx: 3, class: "track" }),
        svg("rect", { x: labelW, y: yTop + bar, width: spentW, height: 14, rx: 3, class: "spent" }),
        svg("rect", { x: labelW + spentW, y: yTop + bar, width: heldW, height: 14, class: "held" }),
      ]);
      group.append(tooltip(
        `${r.label}: spent ${Money.format(r.spent)}, reserved ${Money.format(r.reserved)}` +
        (r.limit === null ? ", no limit" : ` of ${Money.format(r.limit)}`) +
        (r.resetsAt ? `; resets at ${r.resetsAt}` : ""),
      ));
      root.append(group);
    });
    if (!rows.length) root.append(text(W / 2, 24, opts.empty ?? "no budgets with a limit", {
      class: "empty", "text-anchor": "middle",
    }));
    container.replaceChildren(root);
    return root;
  }

  return { PALETTE, stacked, ranking, budgets, html };
})();
