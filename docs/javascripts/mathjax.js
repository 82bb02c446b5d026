// MathJax 3 configuration, read by assets/mathjax/tex-mml-chtml.js (served with the site).
// pymdownx.arithmatex (generic mode) turns both $...$ and \(...\) into
// <span class="arithmatex">\(...\)</span>, and $$...$$ and \[...\] into
// <div class="arithmatex">\[...\]</div>, in the guides and in the API docstrings alike;
// MathJax typesets only those elements, so a dollar sign in a code block stays text.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// Material for MkDocs emits document$ on every page load (also with instant navigation).
document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
