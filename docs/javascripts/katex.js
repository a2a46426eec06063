// Draws the formulas that pymdownx.arithmatex (generic mode) leaves as \( \) inline and \[ \] display spans,
// with the KaTeX copied into the site (docs/hooks/bundled.py); on every page Material shows, instant loads included.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
