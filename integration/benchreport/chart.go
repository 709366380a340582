package main

import (
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"
	"strings"
)

// The chart: one panel per bulk shape (upload, download), one horizontal bar
// per contender with its CPU-s/GiB median, all panels on one scale, and a
// dashed line at floor-ktls (the crypto floor).
const (
	chartWidth   = 960
	chartMargin  = 16
	chartTitleH  = 44 // the title, drawn at twice the font size
	panelHeaderH = 26 // the shape's name
	barRowH      = 22
	axisH        = 28 // tick labels under the bars
	panelGap     = 12
	legendH      = 24
	labelW       = 130 // contender names, left of the bars
	valueW       = 110 // the figure, right of the longest bar
)

var (
	colorBackground = color.RGBA{0xff, 0xff, 0xff, 0xff}
	colorText       = color.RGBA{0x22, 0x22, 0x22, 0xff}
	colorGrid       = color.RGBA{0xe4, 0xe4, 0xe4, 0xff}
	colorThis       = color.RGBA{0x1f, 0x5f, 0xa8, 0xff} // this project's contenders
	colorFloor      = color.RGBA{0x9a, 0x9a, 0x9a, 0xff}
	colorPeer       = color.RGBA{0xe0, 0x7b, 0x28, 0xff}
	colorFloorLine  = color.RGBA{0xc0, 0x39, 0x2b, 0xff}
)

// chartPanels is the bulk shapes' tables, the chart's panels.
func chartPanels(r *Results) []shapeTable {
	var out []shapeTable
	for _, st := range r.tables() {
		if isBulk(st.shape) {
			out = append(out, st)
		}
	}
	return out
}

// chartHeight is the image height for panels with these row counts (an
// empty chart still has room for one line saying so).
func chartHeight(rows []int) int {
	h := chartTitleH + legendH + chartMargin
	if len(rows) == 0 {
		return h + barRowH
	}
	for _, n := range rows {
		h += panelHeaderH + n*barRowH + axisH + panelGap
	}
	return h
}

func barColor(contender string) color.RGBA {
	switch {
	case strings.HasPrefix(contender, "floor-"):
		return colorFloor
	case contender == "ktls" || strings.HasPrefix(contender, "ktls-"):
		return colorThis
	default:
		return colorPeer
	}
}

func renderChart(w io.Writer, r *Results) error {
	panels := chartPanels(r)
	var rows []int
	maxV := 0.0
	for _, st := range panels {
		rows = append(rows, len(st.rows))
		for _, res := range st.rows {
			maxV = math.Max(maxV, res.cpu().Median)
		}
	}
	img := image.NewRGBA(image.Rect(0, 0, chartWidth, chartHeight(rows)))
	draw.Draw(img, img.Bounds(), image.NewUniform(colorBackground), image.Point{}, draw.Src)

	title := "CPU seconds per GiB moved (median), lower is better"
	if r.Mode != "" {
		title += " - " + r.Mode
	}
	drawText(img, chartMargin, chartMargin, title, colorText, 2)
	y := chartTitleH
	if len(panels) == 0 || maxV == 0 {
		drawText(img, chartMargin, y, "no upload/download CPU figures in results.json", colorText, 1)
		return png.Encode(w, img)
	}
	step := niceStep(maxV / 5)
	top := math.Ceil(maxV/step) * step
	x0, x1 := chartMargin+labelW, chartWidth-chartMargin-valueW
	xOf := func(v float64) int { return x0 + int(math.Round(v/top*float64(x1-x0))) }

	shapeWhat := map[string]string{}
	for _, s := range shapes {
		shapeWhat[s.name] = strings.ReplaceAll(s.what, "→", "->")
	}
	for _, st := range panels {
		label := st.shape
		if w := shapeWhat[st.shape]; w != "" {
			label += ": " + w
		}
		drawText(img, chartMargin, y+6, label, colorText, 1)
		y += panelHeaderH
		barsTop, barsBottom := y, y+len(st.rows)*barRowH
		for v := 0.0; v <= top+step/2; v += step {
			x := xOf(v)
			fillRect(img, x, barsTop, x+1, barsBottom, colorGrid)
			label := num(v)
			drawText(img, x-len(label)*glyphAdvance/2, barsBottom+6, label, colorText, 1)
		}
		for i, res := range st.rows {
			ry := y + i*barRowH
			drawText(img, chartMargin, ry+(barRowH-glyphHeight)/2, res.Contender, colorText, 1)
			v := res.cpu().Median
			if v <= 0 {
				drawText(img, x0+4, ry+(barRowH-glyphHeight)/2, dash, colorText, 1)
				continue
			}
			fillRect(img, x0, ry+4, xOf(v), ry+barRowH-4, barColor(res.Contender))
			drawText(img, xOf(v)+6, ry+(barRowH-glyphHeight)/2, num(v), colorText, 1)
		}
		if f := st.by[floorContender].cpu().Median; f > 0 {
			x := xOf(f)
			for yy := barsTop - 4; yy < barsBottom+2; yy += 6 {
				fillRect(img, x, yy, x+2, min(yy+4, barsBottom+2), colorFloorLine)
			}
		}
		y = barsBottom + axisH + panelGap
	}
	lx := chartMargin
	for _, l := range []struct {
		c    color.RGBA
		text string
	}{{colorThis, "caddy-ktls"}, {colorPeer, "peers"}, {colorFloor, "floors"}, {colorFloorLine, "floor-ktls (crypto floor)"}} {
		fillRect(img, lx, y+3, lx+12, y+13, l.c)
		drawText(img, lx+18, y+1, l.text, colorText, 1)
		lx += 18 + (len(l.text)+3)*glyphAdvance
	}
	return png.Encode(w, img)
}

// niceStep rounds v up to 1, 2, 2.5 or 5 times a power of ten.
func niceStep(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func fillRect(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	draw.Draw(img, image.Rect(x0, y0, x1, y1), image.NewUniform(c), image.Point{}, draw.Src)
}

// drawText draws s with its top-left corner at (x, y), each font pixel as a
// scale×scale square. Characters outside ASCII print as '?', except the
// dash used for missing figures, drawn as '-'.
func drawText(img *image.RGBA, x, y int, s string, c color.RGBA, scale int) {
	for _, r := range s {
		if r == '—' {
			r = '-'
		}
		if r < 32 || r > 126 {
			r = '?'
		}
		g := glyphs[(int(r)-32)*glyphHeight:]
		for row := range glyphHeight {
			bits := g[row]
			for col := range glyphWidth {
				if bits&(1<<(6-col)) != 0 {
					fillRect(img, x+col*scale, y+row*scale, x+(col+1)*scale, y+(row+1)*scale, c)
				}
			}
		}
		x += glyphAdvance * scale
	}
}
