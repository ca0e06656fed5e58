// tinkerd console: the live curves (re-fetch the run's curves fragment every few seconds while the
// tab is visible) and confirmations before deletes. Everything else works without scripts.
(function () {
  "use strict";
  var REFRESH_MS = 2000;
  var curves = document.getElementById("curves");
  var live = document.getElementById("live");
  if (curves && curves.dataset.src) {
    var last = curves.innerHTML;
    var tick = function () {
      if (document.hidden) { return; }
      fetch(curves.dataset.src, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
        .then(function (html) {
          if (html !== last) { curves.innerHTML = html; last = html; }
          if (live) { live.textContent = "live"; live.classList.remove("stale"); }
        })
        .catch(function () { if (live) { live.textContent = "not updating"; live.classList.add("stale"); } });
    };
    setInterval(tick, REFRESH_MS);
  }
  document.addEventListener("submit", function (e) {
    var msg = e.target.getAttribute("data-confirm");
    if (msg && !window.confirm(msg)) { e.preventDefault(); }
  });
})();
