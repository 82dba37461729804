// MathJax for the formulas that pymdownx.arithmatex (generic mode) leaves in the
// pages as \( ... \) and \[ ... \] inside elements of class "arithmatex".
// MathJax itself is served from this site (javascripts/mathjax/tex-svg.js, MathJax
// 3.2.2 from its npm package, Apache-2.0): the docs work offline. SVG output embeds
// its glyphs, so nothing else is fetched.
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
  svg: { fontCache: "global" },
};

// MathJax (2 MB) is loaded only by pages that have formulas, from beside this file.
(function () {
  const here = document.currentScript.src;
  document.addEventListener("DOMContentLoaded", function () {
    if (document.querySelector(".arithmatex") === null) return;
    const script = document.createElement("script");
    script.src = new URL("mathjax/tex-svg.js", here).href;
    script.async = true;
    document.head.appendChild(script);
  });
})();
