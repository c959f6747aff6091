// tlsdial calls an HTTPS server as kube-scheduler calls its extenders, for bench/tls_handshake.py:
// Go's net/http and crypto/tls, trusting one CA, presenting a client certificate, checking the
// server's name (client-go's transport for an extender with tlsConfig). It sends -n requests,
// each on a new connection (a full handshake) or all on one kept connection, and prints the CPU
// this process used, so that the difference between the two is what a new connection costs the
// caller. Between its set-up and its timed requests it prints "ready" and waits for a line on
// stdin, so that whoever runs it can read the server's CPU at the same two moments.
package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"syscall"
)

func cpuSeconds() float64 {
	var usage syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &usage); err != nil {
		panic(err)
	}
	return float64(usage.Utime.Nano()+usage.Stime.Nano()) / 1e9
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "tlsdial: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	url := flag.String("url", "", "what to GET, e.g. https://127.0.0.1:8443/healthz")
	caFile := flag.String("ca", "", "the CA the server's certificate must chain to")
	certFile := flag.String("cert", "", "the client certificate")
	keyFile := flag.String("key", "", "its key")
	serverName := flag.String("server-name", "", "the name the server's certificate must carry")
	requests := flag.Int("n", 100, "requests to send")
	fresh := flag.Bool("new-connections", false, "one new connection per request")
	flag.Parse()
	if *url == "" || *caFile == "" || *certFile == "" || *keyFile == "" || *requests < 1 {
		fail("-url, -ca, -cert, -key and -n >= 1 are required")
	}
	caPEM, err := os.ReadFile(*caFile)
	if err != nil {
		fail("%v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		fail("no certificate in %s", *caFile)
	}
	pair, err := tls.LoadX509KeyPair(*certFile, *keyFile)
	if err != nil {
		fail("%v", err)
	}
	transport := &http.Transport{
		TLSClientConfig: &tls.Config{
			RootCAs:      roots,
			Certificates: []tls.Certificate{pair},
			ServerName:   *serverName,
			MinVersion:   tls.VersionTLS12,
		},
		DisableKeepAlives: *fresh,
	}
	client := &http.Client{Transport: transport}
	get := func() {
		answer, err := client.Get(*url)
		if err != nil {
			fail("%v", err)
		}
		if _, err := io.Copy(io.Discard, answer.Body); err != nil {
			fail("%v", err)
		}
		answer.Body.Close()
		if answer.StatusCode != http.StatusOK {
			fail("%s answered %d", *url, answer.StatusCode)
		}
	}
	if !*fresh {
		get() // the kept connection is opened before the clock starts
	}
	fmt.Println("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		fail("waiting for the go-ahead on stdin: %v", err)
	}
	start := cpuSeconds()
	for i := 0; i < *requests; i++ {
		get()
	}
	used := cpuSeconds() - start
	out, _ := json.Marshal(map[string]any{"requests": *requests, "cpu_seconds": used})
	fmt.Println(string(out))
}
