// report.html behaviour (inlined by report_html.py): the Gantt view switch and the code search.
// Everything works on the page's own elements; nothing is fetched.
"use strict";
(function () {
  function showView(name) {
    document.querySelectorAll(".gantt").forEach(function (g) {
      g.classList.toggle("hidden", g.dataset.view !== name);
    });
  }
  var picked = document.querySelector('input[name="view"]:checked');
  if (picked) { showView(picked.value); }
  document.querySelectorAll('input[name="view"]').forEach(function (radio) {
    radio.addEventListener("change", function () { showView(radio.value); });
  });

  var box = document.getElementById("code-search");
  var count = document.getElementById("code-hits");
  var blocks = Array.prototype.slice.call(document.querySelectorAll("details.code"));
  function search() {
    var q = box.value.trim().toLowerCase();
    var lines = 0, files = 0;
    blocks.forEach(function (block) {
      var title = block.querySelector("summary").textContent.toLowerCase();
      var hits = 0;
      block.querySelectorAll(".ln").forEach(function (ln) {
        var hit = q !== "" && ln.textContent.toLowerCase().indexOf(q) >= 0;
        ln.classList.toggle("hit", hit);
        if (hit) { hits += 1; }
      });
      var shown = q === "" || hits > 0 || title.indexOf(q) >= 0;
      block.classList.toggle("hidden", !shown);
      block.open = q !== "" && hits > 0;
      lines += hits;
      if (shown && q !== "") { files += 1; }
    });
    count.textContent = q === "" ? blocks.length + " stage files" :
      lines + " matching lines in " + files + " of " + blocks.length + " stage files";
  }
  if (box) {
    // report.html#search=TEXT opens the page with TEXT searched (a link to a place in the code).
    var preset = /^#search=(.*)$/.exec(window.location.hash);
    if (preset) { box.value = decodeURIComponent(preset[1]); }
    box.addEventListener("input", search);
    search();
  }
})();
