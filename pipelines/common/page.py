"""The look the HTML pages share (`mist show --html`, `mist saliency`): a chain in a
monospace box, kept text shaded green, dropped text struck through."""
STYLE = ("body{font:14px/1.9 sans-serif;max-width:60em;margin:2em auto}"
         ".c{font-family:monospace;white-space:pre-wrap;border:1px solid #ddd;padding:.5em}"
         ".d{color:#bbb;text-decoration:line-through}.k{background:#b9e4b9}")
