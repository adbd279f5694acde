"use strict";
// Exact money for the page. The API writes USD as decimal strings with at most 12 decimals;
// here they become BigInt picodollars (1e-12 USD), are summed as integers and written back as
// decimal text. A float never holds an amount that is shown; only bar lengths use Numbers.

const Money = (() => {
  const PLACES = 12;
  const ONE = 10n ** 12n;
  const AMOUNT = /^(-?)(\d+)(?:\.(\d{0,12}))?$/;

  /** "0.000360" -> 360000000n (picodollars); null stays null. */
  function parse(text) {
    if (text === null || text === undefined) return null;
    const match = AMOUNT.exec(String(text).trim());
    if (!match) throw new Error(`not a USD amount: ${text}`);
    const [, sign, whole, frac = ""] = match;
    const pico = BigInt(whole) * ONE + BigInt(frac.padEnd(PLACES, "0"));
    return sign ? -pico : pico;
  }

  /** The exact sum of decimal strings, in picodollars. */
  function sum(texts) {
    let total = 0n;
    for (const text of texts) total += parse(text) ?? 0n;
    return total;
  }

  /** Plain decimal text, every significant digit: 360000000n -> "0.00036". */
  function plain(pico) {
    const negative = pico < 0n;
    const value = negative ? -pico : pico;
    const frac = (value % ONE).toString().padStart(PLACES, "0").replace(/0+$/, "");
    return `${negative ? "-" : ""}${value / ONE}${frac ? "." + frac : ""}`;
  }

  /** For people: "$1,234.5" -> "$1,234.50"; small amounts keep every digit ("$0.00036"). */
  function format(pico) {
    if (pico === null || pico === undefined) return "no limit";
    const [whole, frac = ""] = plain(pico < 0n ? -pico : pico).split(".");
    const grouped = whole.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return `${pico < 0n ? "-" : ""}$${grouped}.${frac.padEnd(2, "0")}`;
  }

  /** A round axis step (1, 2 or 5 x 10^k) that cuts [0, max] into about `ticks` parts. */
  function niceStep(max, ticks = 4) {
    const raw = max <= 0n ? 1n : (max + BigInt(ticks) - 1n) / BigInt(ticks);
    let power = 1n;
    while (power * 10n <= raw) power *= 10n;
    for (const factor of [1n, 2n, 5n, 10n]) {
      if (factor * power >= raw) return factor * power;
    }
    return 10n * power;
  }

  /** part / whole as a Number in [0, 1+], for drawing only. */
  function ratio(part, whole) {
    if (whole <= 0n) return part > 0n ? 1 : 0;
    return Number((part * 1000000n) / whole) / 1000000;
  }

  /**
   * part / whole as a percentage for people, one decimal, rounded down, so that it is never
   * more than the truth and non-zero spend never reads "0.0%": 1n of 10000n -> "<0.1%".
   */
  function percent(part, whole) {
    if (whole === null || whole === undefined || whole <= 0n) return "";
    if (part <= 0n) return "0%";
    const tenths = (part * 1000n) / whole;
    if (tenths === 0n) return "<0.1%";
    return `${tenths / 10n}.${tenths % 10n}%`;
  }

  /** Integers (token counts) for people: 1234567n -> "1,234,567". */
  function count(value) {
    return BigInt(value).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }

  return { ONE, parse, sum, plain, format, niceStep, ratio, percent, count };
})();
